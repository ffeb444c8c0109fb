"""`kvforge bench soak`: a bounded run of mixed traffic that shows the server leaks nothing.

Starts `kvforge serve` on a free loopback port, sends --duration of Poisson arrivals
(--request-rate) of the seeded mix of soak_traffic.py (at most --max-in-flight open at
once), and every second (more often in runs shorter than MIN_SAMPLES seconds) reads the
server process's resident memory (/proc/PID/status, VmRSS) and its /metrics (KV bytes in
use, requests running and waiting). When the traffic has ended it waits up to
DRAIN_TIMEOUT_S for the server to hold no request and no KV byte.

Fails (exit status 1, one line per property) on any 5xx answer, any unexpected answer,
resident memory grown by RSS_GROWTH_LIMIT or more after warm-up, or KV bytes left in use
after the drain; see soak_stats.py for how each is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvforge.models.loader import load_model_config, resolve_model_source
from kvforge.tools.bench.common import log
from kvforge.tools.bench.serve_client import poisson_schedule
from kvforge.tools.bench.serve_server import METRICS_TIMEOUT_S, ServerProcess, scrape
from kvforge.tools.bench.soak_client import InFlight, SoakRecord, run_traffic
from kvforge.tools.bench.soak_options import SoakOptions, check_options
from kvforge.tools.bench.soak_stats import Sample, counts, failures, kv_drained, latency_drift, rss_growth
from kvforge.tools.bench.soak_traffic import BAD_FRACTION, DISCONNECT_FRACTION, SoakRequest, TrafficMix
from kvforge.tools.text_data import heldout_text

SERVED_NAME = "soak"  # the model name the started server answers to
SAMPLE_INTERVAL_S = 1.0  # the longest gap between two looks at the server
MIN_SAMPLES = 25  # looks per run at least: each fifth the verdicts compare holds several
DRAIN_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.25


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` (Linux /proc); None once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model, "--cache", args.cache, "--dtype", args.dtype, "--threads", str(args.threads),
           "--kv-budget", args.kv_budget, "--served-model-name", SERVED_NAME, "--device", args.device]
    return out + (["--swiftkv", args.swiftkv] if args.swiftkv else [])


def plan_traffic(args: argparse.Namespace, options: SoakOptions, tokenizer: Any) -> tuple[list[SoakRequest], list[float]]:
    """The requests and their send times (seconds), all before --duration."""
    expected = options.request_rate * options.duration_s
    times = poisson_schedule(int(expected + 8 * math.sqrt(expected) + 16), options.request_rate, args.seed)
    times = [t for t in times if t < options.duration_s]
    ids = tokenizer.encode(heldout_text(args.text_file))
    mix = TrafficMix(args.seed, ids, tokenizer.decode, options.vocab_size, SERVED_NAME, options.max_prompt_tokens,
                     args.max_output_tokens)
    return mix.take(len(times)), times


def sample_interval_s(duration_s: float) -> float:
    """Seconds between two looks at the server during a run of `duration_s` seconds."""
    return min(SAMPLE_INTERVAL_S, duration_s / MIN_SAMPLES)


@dataclass
class Sampler:
    """Looks at the server (memory, /metrics) and at the client's open requests."""

    server: ServerProcess
    in_flight: InFlight
    start: float
    interval_s: float = SAMPLE_INTERVAL_S
    samples: list[Sample] = field(default_factory=list)

    async def look(self, metrics_timeout_s: float = METRICS_TIMEOUT_S) -> Sample:
        # The time and the resident memory are read before /metrics is asked: a busy server
        # may answer late (or not within the timeout: its fields are then None), and a late
        # answer must not move the memory reading out of the fifth of the run it belongs to.
        t_s, rss = time.perf_counter() - self.start, rss_bytes(self.server.process.pid)
        metrics = await asyncio.to_thread(scrape, self.server.base_url, None, metrics_timeout_s)
        kv = [value for key, value in metrics.items() if key.startswith("kv_used:")]
        return Sample(t_s, rss, sum(kv) if kv else None, metrics.get("running"), metrics.get("waiting"),
                      self.in_flight.count)

    async def every_interval(self, bar: tqdm, duration_s: float, tally: dict[str, int]) -> None:
        """Looks on a fixed grid (start + k * interval_s). /metrics gets half an interval to
        answer, so a slow server costs that look its server fields, never a grid point."""
        tick = 0
        while True:
            sample = await self.look(metrics_timeout_s=self.interval_s / 2)
            self.samples.append(sample)
            bar.set_postfix(tally | {"in_flight": sample.in_flight}, refresh=False)
            bar.update(max(0, min(int(sample.t_s), int(duration_s)) - bar.n))
            elapsed = time.perf_counter() - self.start
            tick = max(tick + 1, math.ceil(elapsed / self.interval_s))  # the first grid point not yet looked at
            await asyncio.sleep(max(0.0, tick * self.interval_s - elapsed))


async def soak(server: ServerProcess, requests: list[SoakRequest], schedule: list[float], options: SoakOptions,
               args: argparse.Namespace) -> tuple[list[SoakRecord], list[Sample], list[Sample], float]:
    """Runs the traffic with the sampler beside it, then the drain; returns the records,
    the samples during the traffic and after it, and the traffic's seconds."""
    in_flight = InFlight()
    sampler = Sampler(server, in_flight, time.perf_counter(), sample_interval_s(options.duration_s))
    tally = {"done": 0, "5xx": 0, "unexpected": 0}

    def done(record: SoakRecord) -> None:
        tally["done"] += 1
        tally["5xx"] += record.outcome == "server_error"
        tally["unexpected"] += record.outcome == "unexpected"

    with tqdm(total=int(options.duration_s), desc=f"soak {args.model} [{args.cache}]", unit="s",
              file=sys.stderr) as bar:
        watcher = asyncio.create_task(sampler.every_interval(bar, options.duration_s, tally))
        records = await run_traffic(server.base_url, requests, schedule, args.request_timeout, args.max_in_flight,
                                    in_flight, options.duration_s, done)
        traffic_s = time.perf_counter() - sampler.start
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        bar.update(bar.total - bar.n)
    after: list[Sample] = []
    reset = False
    while True:  # the drain: until nothing is held, or the timeout
        after.append(await sampler.look())
        last = after[-1]
        if (last.kv_bytes == 0 and not last.running and not last.waiting) or last.t_s > traffic_s + DRAIN_TIMEOUT_S:
            break
        if not reset and not last.running and not last.waiting:
            # Nothing runs: what is still held is the prefix cache's (kept sequences and
            # snapshots, held by design until evicted); free it, so that anything left after
            # is held by no one: a leak.
            reset = await reset_prefix_cache(server.base_url)
        await asyncio.sleep(DRAIN_POLL_S)
    return records, sampler.samples, after, traffic_s


async def reset_prefix_cache(base_url: str) -> bool:
    """POST /reset_prefix_cache (vLLM's endpoint, kvforge's too); False if refused."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        try:
            return (await client.post("/reset_prefix_cache")).status_code == 200
        except httpx.HTTPError:
            return False


def warm_up(server: ServerProcess, requests: list[SoakRequest], timeout: float) -> None:
    """One short request before the clock starts: first-use costs (kernels built at the
    first step, thread pools) stay out of the soak's first fifth."""
    import httpx

    first = next(r for r in requests if r.expect == "ok") if requests else None
    if first is not None:
        body = {**first.body, "max_tokens": 2, "stream": False}
        body.pop("stream_options", None)
        httpx.post(server.base_url + first.path, json=body, timeout=timeout)


def start_server(args: argparse.Namespace) -> ServerProcess:
    """`kvforge serve` on a free loopback port (tests replace it with a tiny model's server)."""
    return ServerProcess.start(serve_args(args), "soak")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvforge.models.tokenizer import load_tokenizer

    source = resolve_model_source(args.model)
    config = load_model_config(source)
    if args.swiftkv:
        from kvforge.models.swiftkv_checkpoint import overlay_config

        overlay_config(config, args.swiftkv)
    options = check_options(args, config)  # every option checked before the server starts
    requests, schedule = plan_traffic(args, options, load_tokenizer(source))
    log(f"starting kvforge serve ({args.model}, {args.cache}); {len(requests)} requests over "
        f"{options.duration_s:g} s")
    server = start_server(args)
    try:
        warm_up(server, requests, args.request_timeout)
        records, samples, after, traffic_s = asyncio.run(soak(server, requests, schedule, options, args))
        exited = server.process.poll()
    finally:
        server.stop()
    result = _result(args, options, records, samples, after, traffic_s, exited)
    from kvforge.tools.bench.soak_report import format_soak, plot_soak, write_soak_json

    print(format_soak(result), flush=True)
    if args.json:
        write_soak_json(result, Path(args.json))
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        plot_soak(result, Path(plot))
    return result


def _result(args: argparse.Namespace, options: SoakOptions, records: list[SoakRecord], samples: list[Sample],
            after: list[Sample], traffic_s: float, exited: int | None) -> dict[str, Any]:
    from kvforge.tools.report.provenance import provenance

    tally, memory, drained = counts(records), rss_growth(samples, traffic_s), kv_drained(after)
    problems = failures(tally, memory, drained)
    if exited is not None:
        problems.append(f"the server exited during the soak with code {exited}")
    return {
        "benchmark": "soak",
        "model": args.model, "cache": args.cache, "swiftkv": args.swiftkv, "dtype": args.dtype,
        "threads": args.threads,
        "settings": {"duration_s": options.duration_s, "request_rate": options.request_rate,
                     "max_in_flight": args.max_in_flight, "max_prompt_tokens": options.max_prompt_tokens,
                     "max_output_tokens": args.max_output_tokens, "kv_budget": args.kv_budget, "seed": args.seed,
                     "disconnect_fraction": DISCONNECT_FRACTION, "bad_fraction": BAD_FRACTION,
                     "sample_interval_s": sample_interval_s(options.duration_s), "drain_timeout_s": DRAIN_TIMEOUT_S},
        "traffic_s": traffic_s,
        "counts": tally,
        "memory": memory,
        "kv_after_drain": drained,
        "latency_drift": latency_drift(records),
        # Samples with the client's cap on requests in flight reached: the server fell
        # behind the arrivals, and its memory follows a growing load, not only leaks.
        "saturated_fraction": sum(s.in_flight >= args.max_in_flight for s in samples) / max(len(samples), 1),
        "failures": problems,
        "passed": not problems,
        "samples": [s.as_dict() for s in samples],
        "drain_samples": [s.as_dict() for s in after],
        "requests": [{k: v for k, v in r.as_dict().items() if k != "itl_s"} for r in records],
        "provenance": provenance(args),
    }
