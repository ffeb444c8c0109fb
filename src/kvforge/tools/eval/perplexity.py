"""`kvforge eval ppl`: perplexity of every system on the same windows of held-out text.

The text (default: the held-out part of ../shared/data/wikitext-2-raw-test.txt, see
kvforge.tools.text_data) is tokenised once and cut into non-overlapping windows of `context`
tokens (the last partial window is dropped). Models whose tokenizer starts every text
with BOS (Gemma) get BOS as the first token of each window. Every window scores its
`context - 1` next-token predictions, in both modes:
- prefill: the window (but its last token) in one forward call, all rows get logits;
- decode: a prefill of `prefill_len` tokens (its rows score the first predictions), then
  every remaining token is fed alone through the cache, which is what a compressed cache
  changes. Windows run as a batch of `batch` sequences (one decode step for all).
Perplexity = exp(sum of NLL / number of scored tokens) over all windows.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from kvforge.engine.loglikelihood import token_nll, window_nll
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import require
from kvforge.integrations.transformers import cache_argument
from kvforge.models.loader import parse_dtype
from kvforge.preflight import check_within_context
from kvforge.sizes import parse_bytes
from kvforge.tools.eval.compare import EvalSystem, baseline_index, check_backends, parse_systems
from kvforge.tools.eval.context import EvalContext, describe_system, log, make_hf_cache
from kvforge.tools.eval.report import (
    environment,
    evaluate_systems,
    markdown_table,
    relative_delta_pct,
    write_json,
)
from kvforge.tools.eval.storage import hf_quantized_storage, kvforge_storage
from kvforge.tools.report.provenance import provenance
from kvforge.tools.text_data import default_text_file, heldout_text, read_text

Mode = Literal["prefill", "decode"]
WindowScore = tuple[float, int]  # (sum of NLL in nats, tokens scored)


@dataclass(frozen=True)
class PplSettings:
    context: int = 2048
    mode: Mode = "decode"
    prefill_len: int = 64
    batch: int = 8
    max_windows: int | None = None

    def __post_init__(self) -> None:
        require(self.context >= 2, "context", self.context, "must be >= 2")
        require(self.mode in ("prefill", "decode"), "mode", self.mode, "must be prefill or decode")
        # only decode mode prefills a part of the window
        require(self.mode == "prefill" or 1 <= self.prefill_len < self.context, "prefill_len", self.prefill_len,
                f"must be in [1, context={self.context}) in decode mode (the default --mode; its --prefill-len "
                "defaults to 64): give a longer --context, a shorter --prefill-len or --mode prefill")
        require(self.batch >= 1, "batch", self.batch, "must be >= 1")
        require(self.max_windows is None or self.max_windows >= 1, "max_windows", self.max_windows, "must be >= 1")


def starts_with_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and tokenizer.encode("a")[:1] == [bos]


def make_windows(token_ids: Sequence[int], context: int, max_windows: int | None = None,
                 bos: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of `context` tokens; with `bos` each is BOS + context-1 tokens."""
    body = context - (bos is not None)
    count = len(token_ids) // body
    if max_windows is not None:
        count = min(count, max_windows)
    prefix = [bos] if bos is not None else []
    return [prefix + list(token_ids[i * body:(i + 1) * body]) for i in range(count)]


def steps_per_batch(settings: PplSettings) -> int:
    return 1 if settings.mode == "prefill" else settings.context - settings.prefill_len


def score_kvforge(runner: ModelRunner, windows: list[list[int]], settings: PplSettings,
                  advance: Callable[[int], None] = lambda n: None) -> list[WindowScore]:
    """Scores through the kvforge runner; batches of windows share every step."""
    scores: list[WindowScore] = []
    for first in range(0, len(windows), settings.batch):
        batch = windows[first:first + settings.batch]
        seqs = range(len(batch))
        nll = [0.0] * len(batch)
        head = len(batch[0]) - 1 if settings.mode == "prefill" else settings.prefill_len
        try:
            logits = runner.step([StepItem(s, batch[s][:head], num_logits=head) for s in seqs])
            for s in seqs:
                nll[s] += window_nll(logits[s * head:(s + 1) * head], batch[s][1:head + 1])
            advance(1)
            for t in range(head, len(batch[0]) - 1):
                logits = runner.step([StepItem(s, [batch[s][t]]) for s in seqs])
                for s in seqs:
                    nll[s] += window_nll(logits[s:s + 1], [batch[s][t + 1]])
                advance(1)
        finally:
            for s in seqs:
                runner.release(s)
        scores += [(value, len(w) - 1) for value, w in zip(nll, batch)]
    return scores


def score_hf(model: torch.nn.Module, make_cache: Callable[[], Any], windows: list[list[int]],
             settings: PplSettings, advance: Callable[[int], None] = lambda n: None) -> list[WindowScore]:
    """Scores through transformers with a fresh cache per batch (decode mode feeds one token
    at a time with past_key_values, as generate does)."""
    scores: list[WindowScore] = []
    for first in range(0, len(windows), settings.batch):
        batch = torch.tensor(windows[first:first + settings.batch], dtype=torch.long, device=model.device)
        nll = torch.zeros(batch.shape[0], dtype=torch.float64, device=model.device)
        head = batch.shape[1] - 1 if settings.mode == "prefill" else settings.prefill_len
        with torch.inference_mode():
            cache = make_cache() if settings.mode == "decode" else None
            out = model(input_ids=batch[:, :head], **cache_argument(cache), use_cache=cache is not None)
            nll += _batch_nll(out.logits, batch[:, 1:head + 1])
            advance(1)
            for t in range(head, batch.shape[1] - 1):
                out = model(input_ids=batch[:, t:t + 1], **cache_argument(cache), use_cache=True)
                nll += _batch_nll(out.logits, batch[:, t + 1:t + 2])
                advance(1)
        scores += [(float(value), batch.shape[1] - 1) for value in nll]
    return scores


def _batch_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_nll(logits, targets).sum(dim=-1)


def perplexity(scores: Sequence[WindowScore]) -> float:
    tokens = sum(count for _, count in scores)
    return math.exp(sum(nll for nll, _ in scores) / tokens) if tokens else math.nan


def evaluate_system(ctx: EvalContext, system: EvalSystem, windows: list[list[int]],
                    settings: PplSettings) -> dict[str, Any]:
    total = math.ceil(len(windows) / settings.batch) * steps_per_batch(settings)
    start = time.perf_counter()
    storage: dict[str, Any] = {}
    with tqdm(total=total, desc=system.name, unit="step", leave=False) as bar:
        if system.kind == "kvforge":
            runner = ctx.runner(system)
            storage = kvforge_storage(runner.cache, settings.context)
            scores = score_kvforge(runner, windows, settings, bar.update)
        else:
            if system.hf_cache in ("quanto", "hqq") and system.hf_options is not None:
                options = system.hf_options
                storage = hf_quantized_storage(options.bits, options.group, options.residual, ctx.dtype)
            model = ctx.hf_model()
            scores = score_hf(model, lambda: make_hf_cache(system, model), windows, settings, bar.update)
    seconds = time.perf_counter() - start
    ppl = perplexity(scores)
    log(f"{system.name}: ppl {ppl:.4f} over {sum(c for _, c in scores)} tokens ({seconds:.1f} s)")
    return {**describe_system(system), **storage, "ppl": ppl, "nll_sum": sum(n for n, _ in scores),
            "tokens": sum(c for _, c in scores), "seconds": seconds,
            "windows": [{"index": i, "nll": n, "tokens": c, "ppl": math.exp(n / c)}
                        for i, (n, c) in enumerate(scores)]}


def format_ppl_table(systems: list[dict[str, Any]], baseline: int) -> str:
    base = systems[baseline]["ppl"]
    rows = []
    for index, system in enumerate(systems):
        delta = "baseline" if index == baseline else f"{relative_delta_pct(system['ppl'], base):+.2f}%"
        bits = system.get("stored_bits_per_element")
        rows.append([system["name"], f"{system['ppl']:.4f}", delta, "" if bits is None else f"{bits:.2f}",
                     system["tokens"]])
    return markdown_table(["system", "ppl", f"delta vs {systems[baseline]['name']}", "bits/element", "tokens"],
                          rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch = args.batch if args.batch is not None else (1 if args.mode == "prefill" else 8)
    settings = PplSettings(context=args.context, mode=args.mode, prefill_len=args.prefill_len, batch=batch,
                           max_windows=args.max_windows)
    systems = parse_systems(args.cache, args.cache_opt, args.compare, args.swiftkv)
    check_backends(systems, args.compare, args.model)
    base = baseline_index(systems, args.baseline)
    ctx = EvalContext(args.model, parse_dtype(args.dtype), parse_bytes(args.kv_budget), args.swiftkv, args.device)
    check_within_context("context", [settings.context], ctx.context_length(), args.model)
    text_file = args.text_file or str(default_text_file())
    read_text(text_file)  # exists and is text, before any load
    tokenizer = ctx.tokenizer
    ids = tokenizer.encode(heldout_text(text_file), add_special_tokens=False)
    bos = tokenizer.bos_token_id if starts_with_bos(tokenizer) else None
    windows = make_windows(ids, settings.context, settings.max_windows, bos)
    require(len(windows) > 0, "context", settings.context, f"the text has only {len(ids)} tokens")
    log(f"{len(windows)} windows of {settings.context} tokens, mode {settings.mode}, batch {settings.batch}")
    header = {"eval": "ppl", "model": args.model, "dtype": args.dtype, "text_file": text_file,
              "settings": {**vars(settings), "windows": len(windows)}}
    results = evaluate_systems(systems, lambda system: evaluate_system(ctx, system, windows, settings), args.json,
                               header)
    for result in results:
        result["delta_pct"] = relative_delta_pct(result["ppl"], results[base]["ppl"])
    payload = {**header, "baseline": results[base]["name"], "systems": results, "environment": environment(), "provenance": provenance(args)}
    print(f"ppl: {args.model}, {len(windows)} windows x {settings.context} tokens, mode {settings.mode}"
          + (f" (prefill {settings.prefill_len})" if settings.mode == "decode" else ""))
    print(format_ppl_table(results, base))
    if args.json:
        write_json(args.json, payload)
    return payload
