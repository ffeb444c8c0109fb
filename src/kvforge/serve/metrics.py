"""Prometheus metrics of one server (prometheus_client, a registry of its own).

Updated in the engine thread after every step (`observe_step`), rendered by `/metrics`.
Names follow vLLM's where one exists, with the `kvforge_` prefix:
- gauges: requests running / waiting, KV bytes in use and capacity per tier, each cache
  method statistic (`kvforge_cache_statistic{name=...}`, e.g. ShadowKV's chunk_hit_rate);
- counters: preemptions, prompt and generation tokens, finished requests by reason,
  engine steps and their seconds, and with step timing the seconds per part of a step
  (linear, attention, sampling, other);
- histograms: time to first token, time per output token, end-to-end latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.outputs import RequestOutput

# CPU prefill of a long prompt takes seconds to minutes: the buckets reach 10 minutes.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(name, doc, ["model_name", *extra], registry=r)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r)

        self._labels = labels
        self.running = gauge("kvforge_num_requests_running", "Requests holding cache storage").labels(**labels)
        self.waiting = gauge("kvforge_num_requests_waiting", "Requests queued for admission").labels(**labels)
        self.kv_used = gauge("kvforge_kv_cache_bytes_used", "KV-cache bytes in use per tier", ["tier"])
        self.kv_capacity = gauge("kvforge_kv_cache_bytes_capacity", "KV-cache bytes available per tier", ["tier"])
        self.cache_statistic = gauge("kvforge_cache_statistic", "Statistics of the cache method", ["name"])
        self.prefix_statistic = gauge("kvforge_prefix_cache", "Prefix-cache counters (queries, hits, hit tokens, "
                                      "hit rate, kept sequences)", ["name"])
        self.preemptions = counter("kvforge_num_preemptions", "Requests preempted (freed, recomputed later)"
                                   ).labels(**labels)
        self.prompt_tokens = counter("kvforge_prompt_tokens", "Prompt tokens of requests that produced a token"
                                     ).labels(**labels)
        self.generation_tokens = counter("kvforge_generation_tokens", "Tokens generated").labels(**labels)
        self.finished = counter("kvforge_request_finished", "Requests finished, by finish reason", ["finished_reason"])
        self.steps = counter("kvforge_engine_steps", "Engine steps").labels(**labels)
        self.timed_steps = counter("kvforge_engine_timed_steps", "Engine steps timed by part (with --step-timing), "
                                   "by kind: decode (every sequence one generated token) or prefill", ["kind"])
        self.step_seconds = counter("kvforge_engine_step_seconds", "Wall seconds spent in engine steps"
                                    ).labels(**labels)
        self.step_part_seconds = counter("kvforge_engine_step_part_seconds",
                                         "Seconds of engine steps by kind and part (with --step-timing)",
                                         ["kind", "part"])
        self.ttft = histogram("kvforge_time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS
                              ).labels(**labels)
        self.tpot = histogram("kvforge_time_per_output_token_seconds", "Mean time between a request's later tokens",
                              TOKEN_BUCKETS).labels(**labels)
        self.e2e = histogram("kvforge_e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS
                             ).labels(**labels)
        self._preemptions_seen = 0
        self._seen: dict[tuple[str, str], float] = {}

    def observe_step(self, engine: LLMEngine, outputs: Sequence[RequestOutput], seconds: float | None) -> None:
        """Called by the engine thread after each round of commands and step (`seconds`
        None: no step ran, e.g. only aborts)."""
        scheduler, cache = engine.scheduler, engine.cache
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        for tier, value in cache.memory_usage().items():
            self.kv_used.labels(tier=tier, **self._labels).set(value)
        for tier, value in cache.memory.capacity.items():
            self.kv_capacity.labels(tier=tier, **self._labels).set(value)
        for name, value in cache.statistics().items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.cache_statistic.labels(name=name, **self._labels).set(value)
        for name, value in engine.prefix_statistics().items():
            self.prefix_statistic.labels(name=name.removeprefix("prefix_"), **self._labels).set(value)
        self.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.num_preemptions
        if seconds is not None:
            self.steps.inc()
            self.step_seconds.inc(seconds)
        timer = engine.step_timer
        if timer is not None:
            for kind, count in timer.steps.items():
                self._advance(self.timed_steps.labels(kind=kind, **self._labels), ("steps", kind), count)
                for part, total in timer.split(kind).items():
                    self._advance(self.step_part_seconds.labels(kind=kind, part=part, **self._labels),
                                  (kind, part), total)
        for output in outputs:
            self._observe_output(output)

    def _advance(self, counter: Counter, key: tuple[str, str], total: float) -> None:
        """Bring a counter up to a cumulative `total` kept elsewhere."""
        counter.inc(max(0.0, total - self._seen.get(key, 0.0)))
        self._seen[key] = total

    def _observe_output(self, output: RequestOutput) -> None:
        self.generation_tokens.inc(len(output.new_token_ids))
        if output.new_token_ids and len(output.token_ids) == len(output.new_token_ids):  # its first token
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        if not output.finished:
            return
        self.finished.labels(finished_reason=output.finish_reason or "unknown", **self._labels).inc()
        metrics = output.metrics
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.time_per_output_token is not None:
            self.tpot.observe(metrics.time_per_output_token)
        if metrics.latency is not None:
            self.e2e.observe(metrics.latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
