"""`kvforge eval niah`: pass-key retrieval over a grid of lengths x depths, every system on
the same prompts (see passkey.py), greedy generation of a few tokens, accuracy per cell,
a markdown table by length with deltas in points, JSON with every sample, and a heatmap
PNG per system next to the JSON.

kvforge systems run the prompts through the engine's runner in batches (`--batch`),
prefilling in chunks of `--prefill-chunk` tokens as the engine's scheduler would; so a
compressing cache method also sees its own stored (compressed) K/V during a long prefill.
`hf` runs `model.generate` on each prompt alone (no padding).

`--multi-turn K` hides K named needles in one haystack and asks for them in K successive
turns of one conversation (multiturn.py); kvforge systems send each turn to the engine as
a new request carrying the whole conversation, and prefix caching continues the previous
turn's sequence instead of recomputing it; the heatmap rows are then the
needles' depths, and a second table gives accuracy by turn.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.arg_types import positive_ints
from kvforge.engine.conversations import converse_on_engine
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.greedy import greedy_generate
from kvforge.engine.llm_engine import LLMEngine
from kvforge.errors import require
from kvforge.integrations.transformers import cache_argument
from kvforge.models.loader import parse_dtype
from kvforge.models.tokenizer import has_chat_template
from kvforge.preflight import check_within_context
from kvforge.sizes import parse_bytes
from kvforge.tools.eval.compare import EvalSystem, baseline_index, check_backends, parse_systems
from kvforge.tools.eval.context import EvalContext, describe_system, log, make_hf_cache
from kvforge.tools.eval.multiturn import Conversation, accuracy_by_turn, build_conversations, turn_records
from kvforge.tools.eval.passkey import (
    NOISE_SENTENCES,
    PasskeySample,
    build_grid,
    check_key_fits,
    depth_grid,
    score_output,
    split_sentences,
)
from kvforge.tools.eval.report import environment, evaluate_systems, markdown_table, write_json
from kvforge.tools.report.provenance import provenance
from kvforge.tools.text_data import read_text


def stop_ids(ctx: EvalContext) -> list[int]:
    model, tokenizer = ctx.kvforge()
    ids = set(getattr(model.config, "eos_token_ids", ()) or ())
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def generate_kvforge(ctx: EvalContext, system: EvalSystem, samples: list[PasskeySample], max_new_tokens: int,
                     batch: int, prefill_chunk: int, bar: Any) -> list[list[int]]:
    runner = ctx.runner(system)
    stops = stop_ids(ctx)
    outputs: list[list[int]] = []
    for first in range(0, len(samples), batch):
        prompts = [list(s.token_ids) for s in samples[first:first + batch]]
        outputs += greedy_generate(runner, prompts, max_new_tokens, stop_token_ids=stops, prefill_chunk=prefill_chunk)
        bar.update(len(prompts))
    return outputs


def generate_hf(ctx: EvalContext, system: EvalSystem, samples: list[PasskeySample], max_new_tokens: int,
                bar: Any) -> list[list[int]]:
    model = ctx.hf_model()
    stops = stop_ids(ctx)
    outputs = []
    for sample in samples:
        ids = torch.tensor([sample.token_ids], dtype=torch.long, device=model.device)
        cache = make_hf_cache(system, model)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_argument(cache),
                                 do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                 eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0)
        outputs.append(out[0, ids.shape[1]:].tolist())  # a batch of one: never padded
        bar.update(1)
    return outputs


def accuracy_grid(records: list[dict[str, Any]], lengths: list[int], depths: list[float]) -> list[list[float]]:
    """[depth index][length index] -> mean correctness of the cell's samples."""
    grid = []
    for depth_index in range(len(depths)):
        row = []
        for length in lengths:
            cell = [r["correct"] for r in records if r["length"] == length and r["depth_index"] == depth_index]
            row.append(sum(cell) / len(cell) if cell else float("nan"))
        grid.append(row)
    return grid


def converse_kvforge(ctx: EvalContext, system: EvalSystem, conversations: list[Conversation], max_new_tokens: int,
                     batch: int, prefill_chunk: int, bar: Any) -> list[list[list[int]]]:
    """Each turn is a new engine request carrying the whole conversation so far; prefix
    caching finds the previous turn's sequence, so earlier turns are never recomputed."""
    runner = ctx.runner(system)
    model, tokenizer = ctx.kvforge(system.swiftkv)
    config = EngineConfig(kv_budget_bytes=ctx.kv_budget, max_num_batched_tokens=prefill_chunk, max_num_seqs=batch,
                          prefix_caching=True)
    engine = LLMEngine(model, runner.cache, tokenizer, config)
    outputs: list[list[list[int]]] = []
    for first in range(0, len(conversations), batch):
        group = [c.turns for c in conversations[first:first + batch]]
        outputs += converse_on_engine(engine, group, max_new_tokens, stop_ids(ctx), on_finished=lambda _: bar.update(1))
        engine.clear_prefix_cache()  # the next group shares nothing with this one
    return outputs


def converse_hf(ctx: EvalContext, system: EvalSystem, conversations: list[Conversation], max_new_tokens: int,
                bar: Any) -> list[list[list[int]]]:
    """transformers' generate, one conversation at a time, one cache object per conversation
    passed back in every turn: generate then runs only the tokens the cache lacks."""
    model = ctx.hf_model()
    stops = stop_ids(ctx)
    outputs = []
    for conversation in conversations:
        cache = make_hf_cache(system, model)
        ids: list[int] = []
        replies: list[list[int]] = []
        for segment in conversation.turns:
            ids += (replies[-1] if replies else []) + list(segment)
            tensor = torch.tensor([ids], dtype=torch.long, device=model.device)
            with torch.inference_mode():
                out = model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), **cache_argument(cache),
                                     do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                     eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0)
            replies.append(out[0, len(ids):].tolist())
        outputs.append(replies)
        bar.update(1)
    return outputs


def summarise(system: EvalSystem, records: list[dict[str, Any]], lengths: list[int], depths: list[float],
              seconds: float) -> dict[str, Any]:
    accuracy = sum(r["correct"] for r in records) / len(records)
    by_length = {str(n): sum(r["correct"] for r in records if r["length"] == n) / max(1, sum(
        r["length"] == n for r in records)) for n in lengths}
    log(f"{system.name}: accuracy {100 * accuracy:.1f}% ({seconds:.1f} s)")
    return {**describe_system(system), "accuracy": accuracy, "accuracy_by_length": by_length,
            "grid": accuracy_grid(records, lengths, depths), "seconds": seconds, "samples": records}


def evaluate_system(ctx: EvalContext, system: EvalSystem, samples: list[PasskeySample], args: argparse.Namespace,
                    lengths: list[int], depths: list[float]) -> dict[str, Any]:
    tokenizer = ctx.tokenizer
    start = time.perf_counter()
    with tqdm(total=len(samples), desc=system.name, unit="prompt", leave=False) as bar:
        if system.kind == "kvforge":
            outputs = generate_kvforge(ctx, system, samples, args.max_new_tokens, args.batch, args.prefill_chunk, bar)
        else:
            outputs = generate_hf(ctx, system, samples, args.max_new_tokens, bar)
    seconds = time.perf_counter() - start
    records = []
    for sample, generated in zip(samples, outputs):
        text = tokenizer.decode(generated, skip_special_tokens=True)
        records.append({"length": sample.length, "depth": sample.depth, "depth_index": sample.depth_index,
                        "sample": sample.sample_index, "key": sample.key, "prompt_tokens": sample.prompt_tokens,
                        "output": text, "output_ids": generated, "correct": score_output(sample.key, text)})
    return summarise(system, records, lengths, depths, seconds)


def evaluate_conversations(ctx: EvalContext, system: EvalSystem, conversations: list[Conversation],
                           args: argparse.Namespace, lengths: list[int], depths: list[float]) -> dict[str, Any]:
    start = time.perf_counter()
    with tqdm(total=len(conversations), desc=system.name, unit="conversation", leave=False) as bar:
        if system.kind == "kvforge":
            outputs = converse_kvforge(ctx, system, conversations, args.max_new_tokens, args.batch,
                                       args.prefill_chunk, bar)
        else:
            outputs = converse_hf(ctx, system, conversations, args.max_new_tokens, bar)
    seconds = time.perf_counter() - start
    records = [r for c, out in zip(conversations, outputs) for r in turn_records(c, out, ctx.tokenizer, score_output)]
    result = summarise(system, records, lengths, depths, seconds)
    result["accuracy_by_turn"] = accuracy_by_turn(records, args.multi_turn)
    return result


def format_turn_table(results: list[dict[str, Any]], baseline: int) -> str:
    """Accuracy (%) by turn of the conversation, deltas in points vs the baseline."""
    base = results[baseline]["accuracy_by_turn"]
    rows = []
    for turn in range(len(base)):
        cells = [f"{100 * r['accuracy_by_turn'][turn]:.1f}" + (
            "" if i == baseline else f" ({100 * (r['accuracy_by_turn'][turn] - base[turn]):+.1f})")
            for i, r in enumerate(results)]
        rows.append([turn + 1, *cells])
    return markdown_table(["turn"] + [r["name"] for r in results], rows)


def format_niah_table(results: list[dict[str, Any]], lengths: list[int], baseline: int) -> str:
    """Accuracy (%) per length and overall; non-baseline cells carry the delta in points."""
    base = results[baseline]
    headers = ["length"] + [r["name"] for r in results]

    def cell(result: dict[str, Any], value: float, base_value: float, index: int) -> str:
        text = f"{100 * value:.1f}"
        return text if index == baseline else f"{text} ({100 * (value - base_value):+.1f})"

    rows = []
    for length in lengths:
        key = str(length)
        rows.append([length] + [cell(r, r["accuracy_by_length"][key], base["accuracy_by_length"][key], i)
                                for i, r in enumerate(results)])
    rows.append(["all"] + [cell(r, r["accuracy"], base["accuracy"], i) for i, r in enumerate(results)])
    return markdown_table(headers, rows) + f"\n(accuracy %, delta in points vs {base['name']})"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name).strip("_")


def plot_heatmap(result: dict[str, Any], lengths: list[int], depths: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = torch.tensor(result["grid"]).numpy() * 100
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.45 * len(depths) + 1.8))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"{result['name']}: {100 * result['accuracy']:.1f}%", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy %")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def haystack_sentences(path: str | None) -> list[str]:
    if path is None:
        return list(NOISE_SENTENCES)
    sentences = split_sentences(read_text(path))
    require(len(sentences) > 0, "haystack_file", path, "must contain sentences")
    return sentences


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = positive_ints("lengths", args.lengths)
    depths = depth_grid(args.depths)
    require(args.batch >= 1, "batch", args.batch, "must be >= 1")
    require(args.max_new_tokens >= 1, "max_new_tokens", args.max_new_tokens, "must be >= 1")
    systems = parse_systems(args.cache, args.cache_opt, args.compare, args.swiftkv)
    check_backends(systems, args.compare, args.model)
    base = baseline_index(systems, args.baseline)
    ctx = EvalContext(args.model, parse_dtype(args.dtype), parse_bytes(args.kv_budget), args.swiftkv, args.device)
    check_within_context("lengths", lengths, ctx.context_length(), args.model, args.max_new_tokens,
                         "generated tokens (--max-new-tokens)")
    tokenizer = ctx.tokenizer
    chat = bool(args.chat) and has_chat_template(tokenizer)
    if args.chat and not chat:
        log("--chat ignored: the model has no chat template")
    sentences = haystack_sentences(args.haystack_file)
    multi_turn = getattr(args, "multi_turn", None)
    if multi_turn:
        require(not chat, "chat", True, "--multi-turn uses plain-text prompts; leave out --chat")
        depths = depth_grid(multi_turn)  # heatmap rows: where each needle sits
        conversations = build_conversations(tokenizer, lengths, multi_turn, args.seed, sentences,
                                            samples=args.samples, key_digits=args.key_digits)
        check_key_fits(tokenizer, [key for c in conversations for key in c.keys], args.max_new_tokens)
        log(f"{len(conversations)} conversations of {multi_turn} turns: lengths {lengths}, {args.samples} per length")
        results = evaluate_systems(
            systems, lambda system: evaluate_conversations(ctx, system, conversations, args, lengths, depths),
            args.json, {"eval": "niah", "model": args.model, "dtype": args.dtype})
    else:
        samples = build_grid(tokenizer, lengths, args.depths, args.seed, sentences,
                             chat=chat, samples=args.samples, key_digits=args.key_digits)
        check_key_fits(tokenizer, [sample.key for sample in samples], args.max_new_tokens)
        log(f"{len(samples)} prompts: lengths {lengths}, {len(depths)} depths, {args.samples} per cell, chat={chat}")
        results = evaluate_systems(systems, lambda system: evaluate_system(ctx, system, samples, args, lengths, depths),
                                   args.json, {"eval": "niah", "model": args.model, "dtype": args.dtype})
    payload = {"eval": "niah", "model": args.model, "dtype": args.dtype,
               "settings": {"lengths": lengths, "depths": depths, "multi_turn": multi_turn, "samples_per_cell": args.samples,
                            "seed": args.seed, "chat": chat, "key_digits": args.key_digits,
                            "max_new_tokens": args.max_new_tokens, "prefill_chunk": args.prefill_chunk,
                            "haystack_file": args.haystack_file},
               "baseline": results[base]["name"], "systems": results, "environment": environment(), "provenance": provenance(args)}
    shape = f"{multi_turn}-turn conversations" if multi_turn else f"{len(depths)} depths"
    print(f"niah: {args.model}, lengths {lengths} x {shape} x {args.samples} samples")
    print(format_niah_table(results, lengths, base))
    if multi_turn:
        print(format_turn_table(results, base))
    if args.json:
        path = write_json(args.json, payload)
        for result in results:
            png = path.with_name(f"{path.stem}.{slug(result['name'])}.png")
            plot_heatmap(result, lengths, depths, png)
            log(f"wrote {png}")
    return payload
