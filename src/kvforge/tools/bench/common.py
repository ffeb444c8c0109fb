"""What every benchmark shares: its context (options validated before anything loads, the
model described, its weights loaded once and shared, prompts), engines built on it, and the
log. The systems are in systems.py and compare.py, the measuring and its timing rule in
measure.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.cache.registry import create_cache, parse_cache_spec
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
from kvforge.tools.bench.compare import parse_compare
from kvforge.tools.bench.llamacpp_option import check_run
from kvforge.tools.bench.systems import System, kvforge_name, unique_names


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def load_kvforge(model: str, dtype: torch.dtype, swiftkv: str | None = None,
                 device: str = "cpu", load_format: str = "auto") -> tuple[torch.nn.Module, Any, ModelSource]:
    """kvforge model and tokenizer, None for a dummy model: the benchmarks' prompts are token
    ids (tests replace this with a cached loader)."""
    net, source = load_model(model, dtype=dtype, swiftkv=swiftkv, device=device, load_format=load_format)
    return net, None if source.kind == "dummy" else load_tokenizer(source), source


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
    def load_format(self) -> str:
        return getattr(self.args, "load_format", "auto")

    @property
    def weights(self) -> str:
        """What the result says about the weights (random ones under --load-format dummy)."""
        from kvforge.models.dummy_weights import DUMMY_SEED, weights_label

        return weights_label(DUMMY_SEED) if self.load_format == "dummy" else "checkpoint"

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
            model, tokenizer, source = load_kvforge(self.args.model, self.dtype, swiftkv=overlay, device=self.device,
                                                    load_format=self.load_format)
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
                    admission: str = "optimistic", step_timing: bool = False,
                    graph_shape: tuple[int, int] | None = None) -> LLMEngine:
        """A fresh engine on the shared weights, with its own cache of `--kv-budget` bytes.
        Prefix caching only where the system asks for it: benchmarks repeat the same
        prompts, which a cache would otherwise serve from the previous repeat. `step_timing`:
        the engine's `step_timer` records where each step's time goes (kvforge.step_timing).
        `graph_shape` (sequences, tokens): the largest decode step CUDA graphs are captured
        for (the default: every engine-sized bucket)."""
        model, tokenizer = self.model_for(system)
        if system.merge_all_layers:
            from kvforge.tools.bench.merge_all_layers import MergedLayersCache, merged_layout

            cache = MergedLayersCache(create_cache(system.cache, merged_layout(model.cache_layout()), self.kv_budget,
                                                   self.dtype, self.device))
        else:
            cache = create_cache(system.cache, model.cache_layout(), self.kv_budget, self.dtype, self.device)
        config = EngineConfig(kv_budget_bytes=self.kv_budget, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, admission=admission,
                              prefix_caching=bool(system.prefix_caching), step_timing=step_timing,
                              enforce_eager=(system.enforce_eager if system.enforce_eager is not None
                                             else bool(getattr(self.args, "enforce_eager", False))),
                              prepack_weights=getattr(self.args, "prepack_weights", "auto"),
                              **({} if graph_shape is None else dict(max_cudagraph_capture_size=graph_shape[0],
                                                                     max_seq_len_to_capture=graph_shape[1])))
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
            several_budgets: bool = False, hf_static: bool = False) -> BenchContext:
    """Validate options, set the thread count and describe the model (weights load later).
    `llama_cpp`: whether this benchmark can run the llama.cpp peer (`--compare llama.cpp`);
    `hf_static`: whether it can run transformers' compiled static-cache peer (`--compare hf-static`);
    `several_budgets`: whether it takes a comma-separated --kv-budget list."""
    for name in ("threads", "repeats"):
        require(getattr(args, name) >= 1, name, getattr(args, name), "must be >= 1")
    require(args.warmup >= 0, "warmup", args.warmup, "must be >= 0")
    dtype = parse_dtype(args.dtype)
    under_test = parse_cache_spec(args.cache, list(args.cache_opt))
    swiftkv = getattr(args, "swiftkv", None)
    prefix = bool(getattr(args, "prefix_caching", False))
    systems = unique_names([dataclasses.replace(s, prefix_caching=prefix if s.prefix_caching is None else s.prefix_caching)
                            for s in (System(kvforge_name(under_test, swiftkv), "kvforge", under_test),
                                      *parse_compare(args.compare, under_test, swiftkv, llama_cpp,
                                                    hf_static=hf_static))])
    budgets = parse_budgets(args.kv_budget, several_budgets)
    torch.set_num_threads(args.threads)  # before any measurement, including the peak
    source = resolve_model_source(args.model, getattr(args, "load_format", "auto"))
    if llama_cpp:
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


