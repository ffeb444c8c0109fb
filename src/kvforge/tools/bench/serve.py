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
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.cache.registry import parse_cache_spec
from kvforge.errors import ConfigError, KVForgeError, require
from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.tools.bench.common import log
from kvforge.tools.bench.compare import parse_compare
from kvforge.tools.bench.machine_load import LoadProbe
from kvforge.tools.bench.serve_chat import (
    ChatShape,
    conversations,
    median_over,
    run_conversation,
    summarize_conversation,
)
from kvforge.tools.bench.serve_client import RequestRecord, poisson_schedule, run_schedule
from kvforge.tools.bench.serve_result import build_result
from kvforge.tools.bench.serve_server import ServerProcess, ServerWatch, free_loopback_port, scrape
from kvforge.tools.bench.serve_stats import RUN_KEYS, SLO, median_of_runs, step_split, summarize
from kvforge.tools.bench.serve_vllm import STARTUP_TIMEOUT_S as VLLM_STARTUP_TIMEOUT_S
from kvforge.tools.bench.serve_vllm import VllmPeer, peer_checkpoint, vllm_command, vllm_env, vllm_python
from kvforge.tools.bench.systems import System
from kvforge.tools.text_data import heldout_text

WARMUP_TOKENS = 16
SERVED_NAME = "bench"  # the model name the started servers answer to


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
    """Everything decided before any server starts. Poisson: `prompts[i * repeats + r]` are
    the requests of repeat r at rate i, a fresh set for each, so that no run finds a prompt of
    another cached (prefix caching is on in kvforge and vLLM alike); chat: `prompts[r]` are
    conversation r's turns. `warmup` is a short prompt that starts none of them."""

    systems: list[System]
    rates: list[float]
    prompts: list[list[list[int]]]
    output_lens: list[int]
    slo: SLO
    warmup: list[int]
    chat: ChatShape | None = None
    vllm: VllmPeer | None = None


def normalize_base_url(url: str) -> str:
    """The server root of an OpenAI base URL: `http://host:port`, `.../` and `.../v1` alike."""
    text = str(url).strip().rstrip("/")
    require(text.startswith(("http://", "https://")) and len(text.split("://", 1)[1]) > 0, "base_url", url,
            "must be an http(s) URL such as http://127.0.0.1:8000/v1")
    return text.removesuffix("/v1").rstrip("/")


def _plan(args: argparse.Namespace) -> Plan:
    for name in ("threads", "num_prompts", "max_num_batched_tokens", "max_num_seqs", "repeats"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.request_timeout > 0, "request_timeout", args.request_timeout, "must be > 0 seconds")
    rates = parse_rates(args.request_rate)
    input_len = LengthRange.parse("input_len", args.input_len)
    output_len = LengthRange.parse("output_len", args.output_len)
    require(args.workload == "poisson" or output_len.low == output_len.high, "output_len", args.output_len,
            "must be one number N for --workload chat (each reply's length)")
    chat = ChatShape(args.shared_prefix, args.turns, args.question_len, output_len.high) \
        if args.workload == "chat" else None
    slo = SLO.parse(args.slo)
    under_test = parse_cache_spec(args.cache, list(args.cache_opt))
    compare = parse_compare(args.compare, under_test, args.swiftkv, vllm=True, server=True)
    if args.base_url:
        args.base_url = normalize_base_url(args.base_url)
    first = System(f"server[{args.base_url}]", "external") if args.base_url else \
        System(f"swiftkv[{under_test}]" if args.swiftkv else f"kvforge[{under_test}]", "kvforge", under_test)
    peer = None
    if any(system.kind == "vllm" for system in compare):
        # With --swiftkv the peer still serves the base model (--model): the engine a user
        # would run instead, not SwiftKV in vLLM (benchmarks/vllm_swiftkv_prefill.py measures that).
        require(args.device == "cpu", "compare", "vllm", "the vLLM peer is started on the CPU only (its CPU wheel)")
        require(args.load_format == "auto", "load_format", args.load_format,
                "the vLLM peer is given the weights kvforge loads; a dummy model has none: compare kvforge systems")
        peer = VllmPeer(vllm_python(args.vllm_python), Path())  # its checkpoint is written when it starts
    require(args.load_format == "auto" or args.prompt_format == "token-ids", "prompt_format", args.prompt_format,
            "must be token-ids with --load-format dummy (the model has no tokenizer)")
    source = resolve_model_source(args.model, args.load_format)
    config = load_model_config(source)
    if args.swiftkv:
        from kvforge.models.swiftkv_checkpoint import overlay_config

        overlay_config(config, args.swiftkv)
    longest = chat.longest_prompt if chat else input_len.high
    require(longest + output_len.high <= config.max_position_embeddings,
            "shared_prefix + turns" if chat else "input_len + output_len", longest + output_len.high,
            f"must be <= the context of {args.model} ({config.max_position_embeddings} tokens)")
    rng = random.Random(args.seed)
    ids = _random_ids(config.vocab_size, longest, args.seed) if args.load_format == "dummy" else \
        _heldout_ids(source, args.text_file)
    if chat:
        prompts = conversations(ids, chat, args.repeats, args.seed)
        output_lens = [output_len.high] * args.turns
    else:
        lengths = input_len.draw(args.num_prompts, rng)
        output_lens = output_len.draw(args.num_prompts, rng)
        prompts = _prompt_sets(ids, lengths, len(rates) * args.repeats, rng)
    warmup = ids[:WARMUP_TOKENS][::-1]  # the text's opening backwards: no window starts with it
    return Plan([first, *compare], rates, prompts, output_lens, slo, warmup, chat, peer)


def _heldout_ids(source: Any, text_file: str | None) -> list[int]:
    from kvforge.models.tokenizer import load_tokenizer

    return load_tokenizer(source).encode(heldout_text(text_file))


def _random_ids(vocab_size: int, longest: int, seed: int) -> list[int]:
    """The 'text' of a dummy model (no tokenizer): seeded random ids, long enough for
    windows of `longest` tokens at many offsets."""
    rng = random.Random(f"dummy-prompts:{seed}")
    return [rng.randrange(vocab_size) for _ in range(max(4 * longest, 65_536))]


def _prompt_sets(ids: list[int], lengths: list[int], sets: int, rng: random.Random) -> list[list[list[int]]]:
    """`sets` request sets, token-id windows of the held-out text at seeded offsets, no two
    windows starting at the same offset (so none is a cached prefix of another)."""
    longest = max(lengths)
    require(len(ids) > longest, "input_len", longest, f"must be < the {len(ids)} tokens of the held-out text")
    count = sets * len(lengths)
    require(len(ids) - longest >= count, "num_prompts", len(lengths),
            f"x {sets} runs needs {count} distinct prompt starts; the held-out text has {len(ids) - longest}")
    starts = iter(rng.sample(range(1, len(ids) - longest), count))  # offset 0 starts the warm-up's text
    return [[ids[start:start + n] for n, start in zip(lengths, starts)] for _ in range(sets)]


def _serve_args(args: argparse.Namespace, system: System) -> list[str]:
    out = ["--model", args.model, "--load-format", args.load_format, "--cache", str(system.cache), "--kv-budget", args.kv_budget, "--dtype", args.dtype,
           "--threads", str(args.threads), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--admission", args.admission,
           "--prepack-weights", getattr(args, "prepack_weights", "auto"),
           *(["--step-timing"] if args.step_split else []), "--served-model-name", SERVED_NAME, "--device", args.device]
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


def served_model_name(base_url: str, headers: dict[str, str] | None, wanted: str | None) -> str:
    """The model to ask a server for: --served-model-name, else the first /v1/models lists.
    A refused connection, a 401 and an answer that is not a model list each end in one line."""
    import httpx

    url = f"{base_url}/v1/models"
    try:
        response = httpx.get(url, timeout=30, headers=headers)
    except httpx.TransportError as exc:
        raise KVForgeError(f"no server answers at {base_url} ({type(exc).__name__}: {exc}); start it, or check "
                           "--base-url") from None
    if response.status_code in (401, 403):
        raise KVForgeError(f"{url} answered HTTP {response.status_code}: the server wants an API key "
                           f"({'--api-key was refused' if headers else 'pass --api-key KEY'})")
    listed = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    models = [entry.get("id") for entry in listed.get("data", []) if isinstance(entry, dict)] \
        if response.status_code == 200 and isinstance(listed, dict) else []
    if not models:
        raise KVForgeError(f"{url} answered HTTP {response.status_code} without a model list: is --base-url an "
                           "OpenAI-compatible server?")
    if wanted is None:
        return models[0]
    require(wanted in models, "served_model_name", wanted, f"must be one the server lists: {models}")
    return wanted


def _measure(args: argparse.Namespace, plan: Plan, system: System, base_url: str) -> dict[str, Any]:
    from kvforge.models.tokenizer import load_tokenizer

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key and system.kind == "external" else None
    model = SERVED_NAME
    if system.kind == "external":
        model = served_model_name(base_url, headers, args.served_model_name)
    tokenizer = load_tokenizer(resolve_model_source(args.model)) if args.prompt_format == "text" else None
    as_text = args.prompt_format == "text"
    # One short request first: first-touch costs (thread pools, pages) stay out of the runs.
    warm = _body(model, plan.warmup, 2, as_text, tokenizer)
    asyncio.run(run_schedule(base_url, [warm], [0.0], args.request_timeout, headers=headers))
    if plan.chat is not None:
        return {"name": system.name, "kind": system.kind,
                "chat": _measure_chat(args, plan, system, base_url, model, headers, as_text, tokenizer)}
    rates = []
    for index, rate in enumerate(plan.rates):
        before = scrape(base_url, headers)
        runs, pooled, pooled_seconds, watches = [], [], 0.0, []
        for repeat in range(args.repeats):
            prompts = plan.prompts[index * args.repeats + repeat]
            bodies = [_body(model, p, n, as_text, tokenizer) for p, n in zip(prompts, plan.output_lens)]
            schedule = poisson_schedule(len(bodies), rate, args.seed + repeat)
            records, seconds, watch = asyncio.run(_run_rate(
                base_url, bodies, schedule, args.request_timeout,
                f"{system.name} @ {rate:g} req/s" + (f" ({repeat + 1}/{args.repeats})" if args.repeats > 1 else ""),
                headers))
            runs.append(summarize(records, seconds, plan.slo))
            pooled += records
            pooled_seconds += seconds
            watches.append(watch)
        after = scrape(base_url, headers)
        summary = summarize(pooled, pooled_seconds, plan.slo)
        summary.update(watches[-1])
        if "preemptions" in after:
            summary["preemptions"] = int(after["preemptions"] - before.get("preemptions", 0))
        summary["step_split"] = step_split(before, after)
        summary["median_of_runs"] = median_of_runs(runs)
        summary["runs"] = [{key: run[key] for key in RUN_KEYS} for run in runs]
        log(f"{system.name} @ {rate:g} req/s: {summary['completed']} done, {summary['failed']} failed, "
            f"median TTFT {_fmt(summary['median_of_runs']['ttft_ms_median'])} ms, "
            f"{_fmt(summary['median_of_runs']['output_token_throughput'])} output tok/s (medians of "
            f"{len(runs)} runs)")
        rates.append({"request_rate": rate, **summary, "requests": [r.as_dict() for r in pooled]})
    return {"name": system.name, "kind": system.kind, "rates": rates}


def _measure_chat(args: argparse.Namespace, plan: Plan, system: System, base_url: str, model: str,
                  headers: dict[str, str] | None, as_text: bool, tokenizer: Any) -> dict[str, Any]:
    runs = []
    for turns in tqdm(plan.prompts, desc=f"{system.name} chat", unit="conversation", file=sys.stderr):
        bodies = [_body(model, p, n, as_text, tokenizer) for p, n in zip(turns, plan.output_lens)]
        records = asyncio.run(run_conversation(base_url, bodies, args.request_timeout, headers))
        runs.append(summarize_conversation(records))
    out = {"runs": runs, "first_turn_ttft_ms": median_over(runs, "first_turn_ttft_ms"),
           "later_turns_mean_ttft_ms": median_over(runs, "later_turns_mean_ttft_ms"),
           "failed": sum(run["failed"] for run in runs)}
    log(f"{system.name} chat: first turn TTFT {_fmt(out['first_turn_ttft_ms'])} ms, turns 2-{args.turns} mean TTFT "
        f"{_fmt(out['later_turns_mean_ttft_ms'])} ms (medians of {len(runs)} conversations)")
    return out


def _fmt(value: float | None, pattern: str = "{:.1f}") -> str:
    return "-" if value is None else pattern.format(value)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = _plan(args)  # every option checked before a server starts
    torch.set_num_threads(args.threads)
    probe = LoadProbe()
    results = []
    unwaited_cpu_s = 0.0  # of the servers' workers: theirs is this run's CPU time, not foreign load
    for system in plan.systems:
        if system.kind == "external":
            results.append(_measure(args, plan, system, args.base_url))
            continue
        log(f"starting {'vLLM' if system.kind == 'vllm' else 'kvforge'} serve for {system.name}")
        server = _start(args, plan, system)
        try:
            results.append(_measure_profiled(args, plan, system, server))
            if system.kind != "vllm":
                results[-1]["server_start_up"] = server.start_up_lines()
        finally:
            server.stop()
            unwaited_cpu_s += server.unwaited_cpu_s
    result = build_result(args, plan, results, probe.report(also_own_s=unwaited_cpu_s))
    from kvforge.tools.bench.serve_report import format_serve_table, write_serve_outputs

    print(format_serve_table(result))
    if args.json:
        write_serve_outputs(result, Path(args.json))
    return result


def _measure_profiled(args: argparse.Namespace, plan: Plan, system: System, server: ServerProcess) -> dict[str, Any]:
    """`_measure` of a started server, sampled by py-spy throughout with --profile-servers."""
    if not args.profile_servers:
        return _measure(args, plan, system, server.base_url)
    from kvforge.tools.bench.serve_profile import ServerProfiler, engine_steps, summarize_profile

    with tempfile.TemporaryDirectory(prefix="kvforge-profile-") as scratch:
        profiler = ServerProfiler(args.profile_servers, server.process.pid, Path(scratch) / "stacks.txt").start()
        before = scrape(server.base_url)
        try:
            result = _measure(args, plan, system, server.base_url)
        finally:
            raw = profiler.stop()
        result["profile"] = summarize_profile(raw, engine_steps(before, scrape(server.base_url)))
    return result


def _start(args: argparse.Namespace, plan: Plan, system: System) -> ServerProcess:
    if system.kind != "vllm":
        return ServerProcess.start(_serve_args(args, system), system.name)
    assert plan.vllm is not None
    peer = dataclasses.replace(plan.vllm, checkpoint=peer_checkpoint(args.model))
    port = free_loopback_port()
    return ServerProcess.launch(vllm_command(peer, port, args.dtype, args.max_num_batched_tokens, args.max_num_seqs,
                                             SERVED_NAME, log_stats=bool(args.profile_servers)), port, system.name,
                                env=vllm_env(args.kv_budget),
                                timeout_s=VLLM_STARTUP_TIMEOUT_S)
