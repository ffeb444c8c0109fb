"""`kvforge bench prefix`: a conversation over a shared document, with and without prefix
caching, on the same engine settings.

The conversation: turn 1's prompt is `--shared-prefix` tokens of held-out text (the
document) followed by a question (`--question-len` tokens of later held-out text); every
later turn's prompt is the previous turn's prompt, its reply (`--output-len` greedy tokens)
and a new question, as a chat client sends it. Each system serves the whole conversation
`--repeats` times (after `--warmup` untimed runs) with its prefix cache emptied before
each run, and reports each turn's time to first token (the median run).

Two systems: the cache under test with prefix caching, and the same without. The JSON's
top-level `ratio` is the mean TTFT of turns 2..N without prefix caching over the same with
it, and `outputs_identical` says whether every turn's reply was token for token the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from kvforge.engine.sampling import SamplingParams
from kvforge.errors import KVForgeError, require
from kvforge.tools.bench.common import BenchContext, log, prepare
from kvforge.tools.bench.measure import run_systems, timed_rounds
from kvforge.tools.bench.report import Column, finish
from kvforge.tools.bench.systems import System

HEADLINE = "first_tokens_per_s_turns_2_n"  # 1 / mean TTFT of turns 2..N: the ratio is TTFT off / on


def _conversation(ctx: BenchContext, args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(document, one question per turn) as token ids of the held-out text."""
    from kvforge.tools.text_data import heldout_text

    _, tokenizer = ctx.kvforge_model(True)  # the model the systems run (its tokenizer is the base one)
    ids = tokenizer.encode(heldout_text(args.text_file), add_special_tokens=False)
    needed = args.shared_prefix + args.turns * args.question_len
    require(needed <= len(ids), "shared_prefix + turns x question_len", needed,
            f"must be <= the {len(ids)} tokens of the held-out text")
    document = ids[:args.shared_prefix]
    start = args.shared_prefix
    questions = [ids[start + i * args.question_len:start + (i + 1) * args.question_len] for i in range(args.turns)]
    return document, questions


def _kvforge(ctx: BenchContext, system: System) -> dict[str, Any]:
    args = ctx.args
    document, questions = _conversation(ctx, args)
    engine = ctx.make_engine(system, args.max_num_batched_tokens)
    params = SamplingParams.greedy_params(max_tokens=args.output_len, ignore_eos=True)

    def conversation() -> tuple[list[float], list[list[int]], dict[str, float]]:
        engine.clear_prefix_cache()
        before = engine.prefix_statistics()
        history: list[int] = list(document)
        ttfts, replies = [], []
        for question in questions:
            prompt = history + question
            engine.add_request(prompt, params)
            final = None
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.error:
                        raise KVForgeError(f"request failed: {output.error}")
                    final = output if output.finished else final
            ttfts.append(final.metrics.time_to_first_token)
            replies.append(final.token_ids)
            history = prompt + final.token_ids
        after = engine.prefix_statistics()
        stats = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
        # counters subtract; a rate does not: this conversation's own
        queried = stats.get("prefix_queried_tokens", 0)
        if "prefix_hit_rate" in stats:
            stats["prefix_hit_rate"] = stats["prefix_hit_tokens"] / queried if queried else 0.0
        stats["prefix_kept_sequences"] = after.get("prefix_kept_sequences", 0)
        return ttfts, replies, stats

    for index in range(args.warmup):
        conversation()
        log(f"{system.name}: warmup {index + 1}/{args.warmup}")
    runs = []
    for index in range(args.repeats):
        ttfts, replies, stats = conversation()
        later = statistics.mean(ttfts[1:]) if len(ttfts) > 1 else ttfts[0]
        runs.append({"ttft_per_turn": ttfts, "replies": replies, "mean_ttft_turns_2_n": later, "prefix": stats})
        log(f"{system.name}: run {index + 1}/{args.repeats} turn 1 {ttfts[0]:.3f} s, turns 2-{len(ttfts)} "
            f"mean {later:.3f} s")
    ordered = sorted(runs, key=lambda r: r["mean_ttft_turns_2_n"])
    chosen = ordered[len(ordered) // 2]
    seconds_all = [r["mean_ttft_turns_2_n"] for r in runs]
    return {**chosen, "seconds": chosen["mean_ttft_turns_2_n"], "seconds_all": seconds_all,
            "prefix_caching": bool(system.prefix_caching), "prefix_hit_rate": chosen["prefix"].get("prefix_hit_rate")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("shared_prefix", "turns", "question_len", "output_len"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.turns >= 2, "turns", args.turns, "must be >= 2 (turn 1 has nothing cached)")
    total = args.shared_prefix + args.turns * (args.question_len + args.output_len)
    args.compare, args.prefix_caching = [], True
    ctx = prepare(args, tokens_per_sequence=total)
    under_test = ctx.systems[0]
    ctx.systems = [dataclasses.replace(under_test, name=f"{under_test.name} + prefix caching", prefix_caching=True),
                   dataclasses.replace(under_test, name=f"{under_test.name}, no prefix caching", prefix_caching=False)]
    systems = run_systems(ctx, {"kvforge": _kvforge})
    for system in systems:
        system[HEADLINE] = 1.0 / system["mean_ttft_turns_2_n"]
        system["turn1_ttft"] = system["ttft_per_turn"][0]
    identical = systems[0]["replies"] == systems[1]["replies"]
    settings = {"shared_prefix": args.shared_prefix, "turns": args.turns, "question_len": args.question_len,
                "output_len": args.output_len, "max_num_batched_tokens": args.max_num_batched_tokens,
                "repeats": args.repeats, "rounds": timed_rounds(args), "warmup": args.warmup,
                "kv_budget": ctx.kv_budget,
                "timing": "time to first token of each turn's request; the prefix cache is emptied before each run"}
    columns = [Column("turn1_ttft", "turn 1 TTFT s", "{:.3f}"), Column("mean_ttft_turns_2_n", "turns 2-N TTFT s",
                                                                       "{:.3f}"),
               Column("prefix_hit_rate", "hit rate", "{:.2f}")]
    json_path = args.json
    args.json = None  # written below, with the conversation's own fields and plot
    result = finish(ctx, "prefix", settings, HEADLINE, systems, columns)
    result["outputs_identical"] = identical
    print(f"outputs identical with and without prefix caching: {str(identical).lower()}")
    if json_path:
        _write(result, Path(json_path))
    return result


def _write(result: dict[str, Any], path: Path) -> None:
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for system in result["systems"]:
        turns = range(1, len(system["ttft_per_turn"]) + 1)
        axis.plot(turns, system["ttft_per_turn"], "o-", label=system["name"])
    axis.set_xlabel("turn")
    axis.set_ylabel("time to first token (s)")
    axis.set_yscale("log")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(f"kvforge bench prefix: {result['model']}, document {result['settings']['shared_prefix']} tokens\n"
                   f"turns 2-N TTFT ratio {result['ratio']:.1f}x, outputs identical: "
                   f"{str(result['outputs_identical']).lower()}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(figure)
    log(f"wrote {path} and {path.with_suffix('.png')}")
