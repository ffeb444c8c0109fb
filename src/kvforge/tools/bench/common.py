"""What every benchmark shares: the systems under comparison, the context (model, prompts,
options), engine construction and timing.

Timing rule: each system runs `warmup` untimed times (first-call costs: thread pools,
oneDNN/BLAS kernel selection, first touch of the KV pool), then `repeats` timed times; the
reported run is the one with the median time (the upper median for an even count), so its
other counters belong to the same run. All repeat times are kept in `seconds_all`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kvforge.cache.registry import CacheSpec, create_cache, parse_cache_spec, split_spec_list
from kvforge.config import ModelConfig
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.errors import ConfigError, KVForgeError, require
from kvforge.models.loader import (
    ModelSource,
    load_model,
    load_model_config,
    parse_dtype,
    resolve_model_source,
)
from kvforge.models.tokenizer import load_tokenizer
from kvforge.sizes import parse_bytes


@dataclass(frozen=True)
class System:
    """One configuration measured: kvforge with a cache spec, the transformers peer, or the
    llama.cpp peer (bench.llamacpp_peer)."""

    name: str
    kind: Literal["kvforge", "hf", "llama.cpp"]
    cache: CacheSpec | None = None
    # kvforge systems: run the --swiftkv model when one is given (False: SwiftKV's base model).
    swiftkv: bool = True
    # kvforge systems: this system's own SwiftKV checkpoint (`--compare SPEC@DIR`), over --swiftkv
    checkpoint: str | None = None
    # kvforge systems: every layer computes its K/V but one cache layer is stored (merge_all_layers.py)
    merge_all_layers: bool = False
    # kvforge systems: the engine's prefix caching (None: as --prefix-caching says; benchmarks
    # repeat their prompts, so it is off unless asked for)
    prefix_caching: bool | None = None
    # llama.cpp systems: the weights it runs (llamacpp_peer.WEIGHTS: f16, bf16, f32, as-shipped)
    weights: str | None = None


def parse_compare(entries: list[str] | str | None, under_test: CacheSpec | None = None,
                  swiftkv: str | None = None, llama_cpp: bool = False) -> list[System]:
    """`--compare` values -> systems. Each value is a comma-separated list of `hf`, `base`
    (the --swiftkv model's base model with the cache under test), `merge-all-layers` (the
    base model with the cache under test, one cache layer for all: merge_all_layers.py),
    `llama.cpp[:WEIGHTS]` (only where `llama_cpp` says the benchmark has that peer) or cache
    specs; a spec's own `k=v` options may continue after commas
    (`full:storage_dtype=bfloat16,block_size=32`). With --swiftkv, cache-spec systems run
    the SwiftKV model too; `SPEC@DIR` runs the SwiftKV checkpoint DIR, `SPEC@base` the base
    model, whatever --swiftkv says."""
    from kvforge.tools.bench import llamacpp_peer  # imports this module: only imported when parsing
    from kvforge.tools.bench.merge_all_layers import NAME as MERGE_ALL_LAYERS

    items = split_spec_list(entries, bare=("hf", "base", NO_PREFIX_CACHING, MERGE_ALL_LAYERS, llamacpp_peer.PEER))
    systems = []
    for item in items:
        if item == "hf":
            systems.append(System("hf", "hf"))
        elif llamacpp_peer.is_peer(item):
            weights = llamacpp_peer.parse(item, allowed=llama_cpp)
            systems.append(System(llamacpp_peer.system_name(weights), "llama.cpp", weights=weights))
        elif item == NO_PREFIX_CACHING:
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"{_kvforge_name(spec, swiftkv)}, no prefix caching", "kvforge", spec,
                                  prefix_caching=False))
        elif item == "base":
            if swiftkv is None:
                raise ConfigError("compare", item, "'base' is SwiftKV's base model and needs --swiftkv DIR")
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"base[{spec}]", "kvforge", spec, swiftkv=False))
        elif item == MERGE_ALL_LAYERS:
            spec = under_test or parse_cache_spec("full")
            systems.append(System(f"{MERGE_ALL_LAYERS}[{spec}]", "kvforge", spec, swiftkv=False, merge_all_layers=True))
        else:
            systems.append(_cache_system(item, swiftkv))
    return systems


def _cache_system(item: str, swiftkv: str | None) -> System:
    """A `SPEC`, `SPEC@DIR` (the SwiftKV checkpoint DIR) or `SPEC@base` (the base model) entry."""
    text, at, where = item.partition("@")
    require(not at or bool(where.strip()), "compare", item, "SPEC@ must name a SwiftKV checkpoint directory or base")
    try:
        spec = parse_cache_spec(text)
    except ConfigError as exc:
        raise ConfigError("compare", item, "each entry must be hf, base, merge-all-layers, llama.cpp[:WEIGHTS] "
                                           f"or a cache spec, optionally @DIR or @base ({exc})") from exc
    where = where.strip()
    if not at:
        return System(_kvforge_name(spec, swiftkv), "kvforge", spec)
    if where == "base":
        return System(f"base[{spec}]", "kvforge", spec, swiftkv=False)
    return System(f"swiftkv {Path(where).name}[{spec}]", "kvforge", spec, checkpoint=where)


NO_PREFIX_CACHING = "no-prefix-caching"  # --compare: the system under test without prefix caching


def _kvforge_name(spec: CacheSpec, swiftkv: str | None) -> str:
    return f"swiftkv[{spec}]" if swiftkv else f"kvforge[{spec}]"


def unique_names(systems: list[System]) -> list[System]:
    """`--cache full --compare full` measures the same thing twice; keep JSON keys distinct."""
    seen: dict[str, int] = {}
    out = []
    for system in systems:
        seen[system.name] = seen.get(system.name, 0) + 1
        name = system.name if seen[system.name] == 1 else f"{system.name}#{seen[system.name]}"
        out.append(dataclasses.replace(system, name=name))
    return out


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def load_kvforge(model: str, dtype: torch.dtype, swiftkv: str | None = None,
                 device: str = "cpu") -> tuple[torch.nn.Module, Any, ModelSource]:
    """kvforge model and tokenizer (tests replace this with a cached loader)."""
    net, source = load_model(model, dtype=dtype, swiftkv=swiftkv, device=device)
    return net, load_tokenizer(source), source


@dataclass
class BenchContext:
    """Options validated before anything heavy loads, and the shared kvforge model."""

    args: argparse.Namespace
    dtype: torch.dtype
    systems: list[System]
    kv_budget: int  # the budget the systems run under now (bench throughput may step through several)
    config: ModelConfig
    source: ModelSource
    peak: Any = None  # MachinePeak, measured once before the systems run
    probe: Any = None  # LoadProbe started when the measurements start (machine_load.py)
    kv_budgets: tuple[int, ...] = ()  # every --kv-budget value, in the order given
    split_done: set[tuple[str, int]] = field(default_factory=set)  # (system, budget) whose step split ran
    _loaded: dict[str | None, tuple[Any, Any]] = field(default_factory=dict, repr=False)

    @property
    def swiftkv(self) -> str | None:
        return getattr(self.args, "swiftkv", None)

    @property
    def device(self) -> str:
        """Where every system runs, kvforge and transformers alike (--device)."""
        return self.args.device

    def kvforge_model(self, swiftkv: bool = True, checkpoint: str | None = None) -> tuple[Any, Any]:
        """(model, tokenizer), loaded on first use and shared by every kvforge system of the
        same weights: the SwiftKV `checkpoint` when given, else the --swiftkv model unless
        `swiftkv` is False or none was given (then the base model)."""
        overlay = checkpoint or (self.swiftkv if swiftkv else None)
        if overlay not in self._loaded:
            start = time.perf_counter()
            model, tokenizer, source = load_kvforge(self.args.model, self.dtype, swiftkv=overlay, device=self.device)
            if getattr(self.args, "max_position_embeddings", None):  # speed runs past the trained context
                model.config = dataclasses.replace(model.config,
                                                   max_position_embeddings=self.args.max_position_embeddings)
            if overlay is None:
                self.source = source
            self._loaded[overlay] = (model, tokenizer)
            log(f"kvforge {f'SwiftKV {overlay} ' if overlay else ''}model loaded ({time.perf_counter() - start:.1f} s)")
        return self._loaded[overlay]

    def model_for(self, system: System) -> tuple[Any, Any]:
        """The (model, tokenizer) a kvforge system runs."""
        return self.kvforge_model(system.swiftkv, system.checkpoint)

    def make_engine(self, system: System, max_num_batched_tokens: int, max_num_seqs: int = 256,
                    admission: str = "optimistic", step_timing: bool = False) -> LLMEngine:
        """A fresh engine on the shared weights, with its own cache of `--kv-budget` bytes.
        Prefix caching only where the system asks for it: benchmarks repeat the same
        prompts, which a cache would otherwise serve from the previous repeat. `step_timing`:
        the engine's `step_timer` records where each step's time goes (kvforge.step_timing)."""
        model, tokenizer = self.model_for(system)
        if system.merge_all_layers:
            from kvforge.tools.bench.merge_all_layers import MergedLayersCache, merged_layout

            cache = MergedLayersCache(create_cache(system.cache, merged_layout(model.cache_layout()), self.kv_budget,
                                                   self.dtype, self.device))
        else:
            cache = create_cache(system.cache, model.cache_layout(), self.kv_budget, self.dtype, self.device)
        config = EngineConfig(kv_budget_bytes=self.kv_budget, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, admission=admission,
                              prefix_caching=bool(system.prefix_caching), step_timing=step_timing)
        return LLMEngine(model, cache, tokenizer, config)

    def hf_model(self) -> Any:
        """The transformers peer on the same weights and dtype (loaded per call: only the
        `hf` system needs it, and it is freed when that system is done)."""
        from kvforge.tools.bench.hf_peer import load_hf_peer

        start = time.perf_counter()
        model = load_hf_peer(self.source, self.dtype, self.device)
        log(f"transformers model loaded ({time.perf_counter() - start:.1f} s)")
        return model

    def prompts(self, count: int, length: int, shared: int = 0) -> list[list[int]]:
        """Random token ids from a generator seeded by --seed: the same ids for every system;
        with `shared`, every prompt starts with the same `shared` ids (a system prompt)."""
        generator = torch.Generator().manual_seed(self.args.seed)
        ids = torch.randint(0, self.config.vocab_size, (count, length), generator=generator).tolist()
        head = torch.randint(0, self.config.vocab_size, (shared,), generator=generator).tolist()
        return [head + row for row in ids]


def drain(engine: LLMEngine, prompts: list[list[int]], params: Any,
          on_step: Callable[[list[Any]], None] | None = None) -> None:
    """Submit every prompt, then step until all finish; a failed request aborts the run."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.error:
                raise KVForgeError(f"request failed: {output.error}")
        if on_step is not None:
            on_step(outputs)


def parse_budgets(text: str, several: bool) -> tuple[int, ...]:
    """`--kv-budget A[,B...]` -> bytes; several only where the benchmark steps through them."""
    budgets = tuple(parse_bytes(piece.strip()) for piece in str(text).split(","))
    require(several or len(budgets) == 1, "kv-budget", text,
            "takes one size here (several, comma-separated, only in bench throughput)")
    require(len(set(budgets)) == len(budgets), "kv-budget", text, "each budget must appear once")
    return budgets


def prepare(args: argparse.Namespace, tokens_per_sequence: int, llama_cpp: bool = False,
            several_budgets: bool = False) -> BenchContext:
    """Validate options, set the thread count and describe the model (weights load later).
    `llama_cpp`: whether this benchmark can run the llama.cpp peer (`--compare llama.cpp`);
    `several_budgets`: whether it takes a comma-separated --kv-budget list."""
    for name in ("threads", "repeats"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.warmup >= 0, "warmup", args.warmup, "must be >= 0")
    dtype = parse_dtype(args.dtype)
    under_test = parse_cache_spec(args.cache, list(args.cache_opt))
    swiftkv = getattr(args, "swiftkv", None)
    prefix = bool(getattr(args, "prefix_caching", False))
    systems = unique_names([dataclasses.replace(s, prefix_caching=prefix if s.prefix_caching is None else s.prefix_caching)
                            for s in (System(_kvforge_name(under_test, swiftkv), "kvforge", under_test),
                                      *parse_compare(args.compare, under_test, swiftkv, llama_cpp))])
    budgets = parse_budgets(args.kv_budget, several_budgets)
    torch.set_num_threads(args.threads)  # before any measurement, including the peak
    source = resolve_model_source(args.model)
    if llama_cpp:
        from kvforge.tools.bench.llamacpp_peer import check_run

        check_run(systems, source.kind, args.device)
    config = load_model_config(source)
    if getattr(args, "max_position_embeddings", None):
        config = dataclasses.replace(config, max_position_embeddings=args.max_position_embeddings)
    check_checkpoints(config, args.model, swiftkv, systems)
    require(tokens_per_sequence <= config.max_position_embeddings, "sequence length", tokens_per_sequence,
            f"must be <= max_position_embeddings={config.max_position_embeddings} of {args.model} "
            "(--max-position-embeddings N raises it for speed runs)")
    return BenchContext(args, dtype, systems, budgets[0], config, source, kv_budgets=budgets)


def check_checkpoints(config: ModelConfig, model: str, swiftkv: str | None, systems: list[System]) -> None:
    """A bad --swiftkv or SPEC@DIR checkpoint fails before anything loads."""
    from kvforge.models.swiftkv_checkpoint import overlay_config

    if swiftkv is not None:
        overlay_config(config, swiftkv)
    for system in systems:
        if system.checkpoint is None:
            continue
        try:
            overlay_config(config, system.checkpoint)
        except (OSError, KVForgeError) as exc:
            raise ConfigError("compare", system.checkpoint,
                              f"SPEC@DIR must name a SwiftKV checkpoint of {model} ({exc})") from exc


Runner = Callable[[BenchContext, System], dict[str, Any]]


def run_systems(ctx: BenchContext, runners: Mapping[str, Runner]) -> list[dict[str, Any]]:
    """Measure every system with the runner registered for its kind, freeing between systems."""
    start_measuring(ctx)
    systems = measure_systems(ctx, runners)
    finish_measuring(ctx)
    return systems


def start_measuring(ctx: BenchContext) -> None:
    """Before the first timed region: build every kernel, start the load probe, measure the
    machine's peaks."""
    from kvforge.prebuild import build_cpu_kernels
    from kvforge.tools.bench.machine_load import LoadProbe
    from kvforge.tools.bench.peak import READ_PASSES, measure_peak

    # Every kernel is built before the first timed region (a compile once cost 26 s of a
    # timed ShadowKV decode when --warmup 0 left nothing to build it earlier).
    kernels, seconds = build_cpu_kernels()
    ready = [name for name, ok in kernels.items() if ok]
    missing = [name for name, ok in kernels.items() if not ok]
    log(f"C++ kernels ready in {seconds:.1f} s: {', '.join(ready) or 'none'}"
        + (f"; PyTorch fallback for: {', '.join(missing)}" if missing else ""))
    ctx.probe = LoadProbe()
    ctx.peak = measure_peak(ctx.dtype, torch.device(ctx.device))
    log(f"matmul peak {ctx.peak.matmul_gflops:.1f} GFLOP/s ({ctx.peak.matmul_dtype}, n={ctx.peak.matmul_size}), "
        f"read bandwidth {ctx.peak.read_gbps:.1f} GB/s"
        + (f" (median of {READ_PASSES} passes; best {ctx.peak.read_gbps_best:.1f})"
           if ctx.peak.read_gbps_best is not None else "")
        + f", on {ctx.peak.device}"
        + (f", {ctx.peak.threads} threads" if ctx.peak.device == "cpu" else ""))


def finish_measuring(ctx: BenchContext) -> None:
    """After the last timed region: the read probe again (CPU), so that the bandwidth the
    systems are compared with is the median of passes taken before and after them
    (peak.with_read_after)."""
    from kvforge.tools.bench.peak import with_read_after

    ctx.peak = with_read_after(ctx.peak)
    if ctx.peak.read_gbps_after is not None:
        log(f"read bandwidth after the systems {ctx.peak.read_gbps_after:.1f} GB/s (before "
            f"{ctx.peak.read_gbps_before:.1f}); compared with: {ctx.peak.read_gbps:.1f} GB/s, the median of "
            f"{len(ctx.peak.read_passes_gbps)} passes")


def measure_systems(ctx: BenchContext, runners: Mapping[str, Runner]) -> list[dict[str, Any]]:
    """Every system, measured by the runner registered for its kind (after `start_measuring`).

    With `--rounds R` > 1 the whole list is measured R times, in reverse order on every other
    round (A B, B A, A B, ...), and each system's rounds are merged (`merge_rounds`). Systems
    measured one after another see whatever the machine does meanwhile; a long command on a
    shared machine drifts (one system's runs in a quiet hour, the next one's in a busy one),
    and alternating spreads that drift over every system alike."""
    for system in ctx.systems:
        if system.kind not in runners:
            raise KVForgeError(f"no runner for system kind {system.kind!r}")
    rounds = timed_rounds(ctx.args)
    per_round: list[dict[str, dict[str, Any]]] = []
    for index in range(rounds):
        order = list(ctx.systems) if index % 2 == 0 else list(reversed(ctx.systems))
        if rounds > 1:
            log(f"round {index + 1}/{rounds}: {', '.join(system.name for system in order)}")
        results = {}
        for system in order:
            metrics = runners[system.kind](ctx, system)
            results[system.name] = {"name": system.name, "kind": system.kind, **metrics}
            gc.collect()  # the runner's engine (KV pool) or transformers model is garbage now
        per_round.append(results)
    return [merge_rounds([results[system.name] for results in per_round]) for system in ctx.systems]


def timed_rounds(args: Any) -> int:
    """`--rounds` (1 where a benchmark has no such argument)."""
    return int(getattr(args, "rounds", 1) or 1)


def timed_runs(args: Any) -> int:
    """Timed runs per system over the whole command: repeats in each of the rounds."""
    return int(args.repeats) * timed_rounds(args)


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's results from several rounds as one: the counters of the round whose
    chosen run is the median by time (the upper one of an even count, as `repeat_runs`), all
    rounds' repeat times in `seconds_all` (in the order they ran) and the fastest in
    `seconds_min`. Keys that only some rounds measured (bench throughput's step split runs
    in the first round only) are kept from the round that has them."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda run: run["seconds"])
    chosen = ordered[len(ordered) // 2]
    times = [t for run in runs for t in (run.get("seconds_all") or [run["seconds"]])]
    only_some = {key: value for run in runs for key, value in run.items() if key not in chosen}
    return {**only_some, **chosen, "seconds_all": times, "seconds_min": min(times), "rounds": len(runs)}


def repeat_runs(label: str, once: Callable[[], dict[str, Any]], warmup: int, repeats: int) -> dict[str, Any]:
    """Run `once` (which times itself and returns {"seconds": ..., counters...}) warmup +
    repeats times; return the median-time run with `seconds_all`."""
    for index in range(warmup):
        run = once()
        log(f"{label}: warmup {index + 1}/{warmup} {run['seconds']:.3f} s")
    runs = []
    for index in range(repeats):
        run = once()
        runs.append(run)
        log(f"{label}: run {index + 1}/{repeats} {run['seconds']:.3f} s")
    ordered = sorted(runs, key=lambda r: r["seconds"])
    chosen = ordered[len(ordered) // 2]
    # The fastest run too: on a shared machine the gap between median and min shows noise.
    return {**chosen, "seconds_all": [r["seconds"] for r in runs], "seconds_min": ordered[0]["seconds"]}


def rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else float("inf")
