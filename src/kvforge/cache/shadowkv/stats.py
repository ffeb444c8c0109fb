"""Counters and cumulative phase timers of the `shadowkv` method.

Phases (seconds, time.perf_counter, summed over layers and steps): selection (landmark
scores + top-k), rebuild (matching picks to reuse slots, keys of missed chunks from the
low-rank store + RoPE, writing them into the slots), fetch (values of missed chunks from
the slow tier), attention (the sparse attention itself),
compress (Algorithm 1 at a sequence's first decode step), fold (generated chunks into the
store). On the CPU every phase is timed. On CUDA kernels run asynchronously, so a host
clock alone would time their launches: there phases are timed only while engine step
timing records (`EngineConfig(step_timing=True)`, kvforge.step_timing), each
synchronising the device first and last, so the seconds are the device's work. Otherwise
they stay 0 and the decode path never synchronises for them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvforge.step_timing import current_timer

PHASES = ("selection", "rebuild", "fetch", "attention", "compress", "fold")


@dataclass
class ShadowKVStats:
    _hits: int = 0  # selected chunks found in the previous step's reuse cache
    _misses: int = 0  # selected chunks rebuilt and fetched
    # [misses, hits] of steps whose counts stayed on the device (a decode path that never
    # waits for the host), added in when the counts are read. One tensor for the cache's
    # life, only ever updated in place: a captured step (CUDA graph) adds into it.
    _pending: torch.Tensor | None = field(default=None, repr=False, compare=False)
    compressions: int = 0  # sequences compressed
    folded_chunks: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    device_type: str = "cpu"  # of the compute device: "cuda" times phases only under step timing
    # Ranks chosen at compression, summed per global layer over compressed sequences, and
    # the count of those sequences: what the cache did, so `reset` keeps them (compression
    # happens in the prefill, before a benchmark's timed phase resets the counters).
    rank_sums: list[int] = field(default_factory=list)
    ranked_sequences: int = 0

    def record_ranks(self, ranks: list[int]) -> None:
        if not self.rank_sums:
            self.rank_sums = [0] * len(ranks)
        self.rank_sums = [total + rank for total, rank in zip(self.rank_sums, ranks)]
        self.ranked_sequences += 1

    @property
    def layer_ranks(self) -> list[float]:
        """Mean rank of each global layer over the sequences compressed so far."""
        return [total / self.ranked_sequences for total in self.rank_sums] if self.ranked_sequences else []

    def device_counter(self, device: torch.device) -> torch.Tensor:
        """The [misses, hits] int64 tensor on `device` that kernels add a layer's counts into
        without the host reading them."""
        if self._pending is None:
            self._pending = torch.zeros(2, dtype=torch.int64, device=device)
        return self._pending

    def _settle(self) -> None:
        if self._pending is not None:
            misses, hits = self._pending.tolist()
            self._misses, self._hits = self._misses + misses, self._hits + hits
            with torch.inference_mode():  # made in a step, under inference mode
                self._pending.zero_()

    def count(self, misses: int, hits: int) -> None:
        """Add counts the host knows (nothing is read from the device)."""
        self._misses += misses
        self._hits += hits

    @property
    def chunk_hits(self) -> int:
        self._settle()
        return self._hits

    @property
    def chunk_misses(self) -> int:
        self._settle()
        return self._misses

    def reset(self) -> None:
        self._settle()
        self._hits = self._misses = self.compressions = self.folded_chunks = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        cuda = self.device_type == "cuda"
        if cuda and current_timer() is None:
            yield
            return
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start

    @property
    def hit_rate(self) -> float:
        total = self.chunk_hits + self.chunk_misses
        return self.chunk_hits / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {"chunk_hit_rate": self.hit_rate, "chunk_hits": self.chunk_hits,
                                 "chunk_misses": self.chunk_misses, "compressions": self.compressions,
                                 "folded_chunks": self.folded_chunks}
        out.update({f"seconds_{phase}": value for phase, value in self.seconds.items()})
        ranks = self.layer_ranks
        if ranks:
            out["rank_mean"] = sum(ranks) / len(ranks)
            out.update({f"rank_layer_{index}": rank for index, rank in enumerate(ranks)})
        return out
