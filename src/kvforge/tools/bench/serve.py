"""`kvforge bench serve`: serving latency and throughput under Poisson arrivals.

Each system is a `kvforge serve` process started here on a loopback port (the system under
test from --cache/--swiftkv, then every --compare entry: `base` or cache specs), or the
OpenAI-compatible server at --base-url (vLLM, llama.cpp's server, another kvforge). For
every --request-rate (requests per second; `inf` sends all at once) the same schedule of
--num-prompts requests is replayed against each system: identical send times and prompts
(held-out text, sent as token ids so every system sees exactly --input-len tokens),
--output-len tokens each (max_tokens = min_tokens, ignore_eos).

Reported per system and rate: completed and failed requests, request / output-token /
total-token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99),
goodput under --slo, and from a kvforge server's /metrics the requests running (mean,
max), preemptions and the time of a decode step split into linear layers, attention,
sampling and the rest. Headline `ratio`: the first comparison system's median TTFT over
the system under test's at the lowest rate (> 1: the system under test answers sooner).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.cache.registry import parse_cache_spec
from kvforge.errors import ConfigError, require
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.tools.bench.common import log
from kvforge.tools.bench.compare import parse_compare
from kvforge.tools.bench.machine_load import LoadProbe, flags
from kvforge.tools.bench.serve_client import RequestRecord, poisson_schedule, run_schedule
from kvforge.tools.bench.serve_server import ServerProcess, ServerWatch, scrape
from kvforge.tools.bench.serve_stats import SLO, step_split, summarize
from kvforge.tools.bench.systems import System
from kvforge.tools.report.provenance import provenance
from kvforge.tools.text_data import heldout_text

SERVED_NAME = "bench"  # the model name the started servers answer to
HEADLINE = "median_ttft_ms"


@dataclasses.dataclass(frozen=True)
class LengthRange:
    low: int
    high: int

    @classmethod
    def parse(cls, parameter: str, text: str) -> LengthRange:
        """`N` or `A:B` (inclusive, drawn uniformly per request)."""
        low_text, sep, high_text = str(text).partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise ConfigError(parameter, text, "must be N or A:B with integers") from None
        require(1 <= low <= high, parameter, text, "must be N >= 1 or A:B with 1 <= A <= B")
        return cls(low, high)

    def draw(self, count: int, rng: random.Random) -> list[int]:
        return [rng.randint(self.low, self.high) for _ in range(count)]


def parse_rates(text: str) -> list[float]:
    rates = []
    for piece in str(text).split(","):
        piece = piece.strip().lower()
        try:
            rate = float(piece)
        except ValueError:
            raise ConfigError("request_rate", piece, "must be a positive number of requests/s or inf") from None
        require(rate > 0, "request_rate", piece, "must be > 0 (inf: all at once)")
        rates.append(rate)
    require(len(set(rates)) == len(rates), "request_rate", text, "must not repeat a rate")
    return sorted(rates)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything decided before any server starts."""

    systems: list[System]
    rates: list[float]
    prompts: list[list[int]]
    output_lens: list[int]
    slo: SLO


def _plan(args: argparse.Namespace) -> Plan:
    for name in ("threads", "num_prompts", "max_num_batched_tokens", "max_num_seqs"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.request_timeout > 0, "request_timeout", args.request_timeout, "must be > 0 seconds")
    rates = parse_rates(args.request_rate)
    input_len = LengthRange.parse("input_len", args.input_len)
    output_len = LengthRange.parse("output_len", args.output_len)
    slo = SLO.parse(args.slo)
    under_test = parse_cache_spec(args.cache, list(args.cache_opt))
    compare = parse_compare(args.compare, under_test, args.swiftkv)
    if any(system.kind == "hf" for system in compare):
        raise ConfigError("compare", "hf", "transformers has no server: compare kvforge systems, or run another "
                                           "server yourself and measure it with --base-url")
    for system in compare:
        require(not system.merge_all_layers, "compare", system.name,
                "merge-all-layers is a bench throughput/decode system; kvforge serve has no such option")
    first = System(f"server[{args.base_url}]", "external") if args.base_url else \
        System(f"swiftkv[{under_test}]" if args.swiftkv else f"kvforge[{under_test}]", "kvforge", under_test)
    source = resolve_model_source(args.model)
    config = load_model_config(source)
    if args.swiftkv:
        from kvforge.models.swiftkv_checkpoint import overlay_config

        overlay_config(config, args.swiftkv)
    require(input_len.high + output_len.high <= config.max_position_embeddings, "input_len + output_len",
            input_len.high + output_len.high, f"must be <= the context of {args.model} "
                                              f"({config.max_position_embeddings} tokens)")
    rng = random.Random(args.seed)
    lengths = input_len.draw(args.num_prompts, rng)
    return Plan([first, *compare], rates, _prompts(source, args.text_file, lengths, rng),
                output_len.draw(args.num_prompts, rng), slo)


def _prompts(source: Any, text_file: str | None, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Token-id windows of the held-out text, one per request, at seeded offsets."""
    from kvforge.models.tokenizer import load_tokenizer

    ids = load_tokenizer(source).encode(heldout_text(text_file))
    require(len(ids) > max(lengths), "input_len", max(lengths),
            f"must be < the {len(ids)} tokens of the held-out text")
    return [ids[start:start + n] for n, start in ((n, rng.randrange(len(ids) - n)) for n in lengths)]


def _serve_args(args: argparse.Namespace, system: System) -> list[str]:
    out = ["--model", args.model, "--cache", str(system.cache), "--kv-budget", args.kv_budget, "--dtype", args.dtype,
           "--threads", str(args.threads), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--admission", args.admission, "--step-timing",
           "--served-model-name", SERVED_NAME, "--device", args.device]
    overlay = system.checkpoint or (args.swiftkv if system.swiftkv else None)
    if overlay:
        out += ["--swiftkv", overlay]
    return out


def _body(model: str, prompt: list[int], output_len: int, as_text: bool, tokenizer: Any) -> dict[str, Any]:
    return {"model": model, "prompt": tokenizer.decode(prompt) if as_text else prompt, "max_tokens": output_len,
            "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


async def _run_rate(base_url: str, bodies: list[dict[str, Any]], schedule: list[float], timeout: float,
                    label: str, headers: dict[str, str] | None) -> tuple[list[RequestRecord], float, dict]:
    watch = ServerWatch(base_url, headers=headers)
    watcher = asyncio.create_task(watch.watch())
    with tqdm(total=len(bodies), desc=label, unit="req", file=sys.stderr) as bar:
        records, seconds = await run_schedule(base_url, bodies, schedule, timeout, lambda _: bar.update(1), headers)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    return records, seconds, watch.summary()


def _measure(args: argparse.Namespace, plan: Plan, system: System, base_url: str) -> dict[str, Any]:
    import httpx

    from kvforge.models.tokenizer import load_tokenizer

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    model = SERVED_NAME
    if system.kind == "external":
        listed = httpx.get(f"{base_url}/v1/models", timeout=30, headers=headers).json()
        model = args.served_model_name or listed["data"][0]["id"]
    tokenizer = load_tokenizer(resolve_model_source(args.model)) if args.prompt_format == "text" else None
    as_text = args.prompt_format == "text"
    # One short request first: first-touch costs (thread pools, pages) stay out of the runs.
    warm = _body(model, plan.prompts[0][:16], 2, as_text, tokenizer)
    asyncio.run(run_schedule(base_url, [warm], [0.0], args.request_timeout, headers=headers))
    bodies = [_body(model, p, n, as_text, tokenizer) for p, n in zip(plan.prompts, plan.output_lens)]
    rates = []
    for rate in plan.rates:
        schedule = poisson_schedule(len(bodies), rate, args.seed)
        before = scrape(base_url, headers)
        records, seconds, watch = asyncio.run(_run_rate(base_url, bodies, schedule, args.request_timeout,
                                                           f"{system.name} @ {rate:g} req/s", headers))
        after = scrape(base_url, headers)
        summary = summarize(records, seconds, plan.slo)
        summary.update(watch)
        if "preemptions" in after:
            summary["preemptions"] = int(after["preemptions"] - before.get("preemptions", 0))
        summary["step_split"] = step_split(before, after)
        log(f"{system.name} @ {rate:g} req/s: {summary['completed']} done, {summary['failed']} failed, "
            f"median TTFT {_fmt(summary['ttft_ms']['median'])} ms, {summary['request_throughput']:.3f} req/s")
        rates.append({"request_rate": rate, **summary, "requests": [r.as_dict() for r in records]})
    return {"name": system.name, "kind": system.kind, "rates": rates}


def _fmt(value: float | None, pattern: str = "{:.1f}") -> str:
    return "-" if value is None else pattern.format(value)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = _plan(args)  # every option checked before a server starts
    torch.set_num_threads(args.threads)
    probe = LoadProbe()
    results = []
    for system in plan.systems:
        if system.kind == "external":
            results.append(_measure(args, plan, system, args.base_url.rstrip("/")))
            continue
        log(f"starting kvforge serve for {system.name}")
        server = ServerProcess.start(_serve_args(args, system), system.name)
        try:
            results.append(_measure(args, plan, system, server.base_url))
        finally:
            server.stop()
    result = _result(args, plan, results, probe.report())
    from kvforge.tools.bench.serve_report import format_serve_table, write_serve_outputs

    print(format_serve_table(result))
    if args.json:
        write_serve_outputs(result, Path(args.json))
    return result


def _result(args: argparse.Namespace, plan: Plan, systems: list[dict[str, Any]],
            load: dict[str, Any]) -> dict[str, Any]:
    def at(system: dict[str, Any], rate: float) -> dict[str, Any]:
        return next(r for r in system["rates"] if r["request_rate"] == rate)

    lowest, highest = plan.rates[0], plan.rates[-1]
    ratios, throughput_ratios = {}, {}
    ours = systems[0]
    for other in systems[1:]:
        mine, theirs = at(ours, lowest)["ttft_ms"]["median"], at(other, lowest)["ttft_ms"]["median"]
        ratios[other["name"]] = theirs / mine if mine and theirs else None
        mine_rps, theirs_rps = at(ours, highest)["request_throughput"], at(other, highest)["request_throughput"]
        throughput_ratios[other["name"]] = mine_rps / theirs_rps if theirs_rps else None
    first = next(iter(ratios.values()), None)
    return {
        "benchmark": "serve",
        "model": args.model,
        "swiftkv": args.swiftkv,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "settings": {
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "request_rates": ["inf" if math.isinf(r) else r for r in plan.rates], "seed": args.seed,
            "kv_budget": args.kv_budget, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs, "admission": args.admission, "prompt_format": args.prompt_format,
            "slo": plan.slo.as_dict(), "base_url": args.base_url,
            "timing": "client clock; TTFT = send -> first streamed token, TPOT = (latency - TTFT) / (tokens - 1)",
        },
        "headline_metric": f"{HEADLINE} at the lowest rate ({lowest:g} req/s): comparison / system under test",
        "ratio": first,
        "ratios": ratios,
        "throughput_ratios_at_highest_rate": throughput_ratios,
        "systems": systems,
        "environment": {"torch": torch.__version__, **load},
        "flags": (warnings := flags(load)),
        "trustworthy": not warnings,
        "provenance": provenance(args),
    }
