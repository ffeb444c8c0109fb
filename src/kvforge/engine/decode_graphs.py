"""Decode-only steps replayed from CUDA graphs: one captured step per bucket of (sequences,
sequence length) and form of its step (one, except ShadowKV's buckets that can hold
compressed sequences: two), launched as one graph instead of thousands of kernels from Python.

A bucket is `rows` sequences (powers of two up to `max_num_seqs`) of at most `max_tokens`
tokens (powers of two from 512 up to `max_seq_len_to_capture`, vLLM's name). Its step
reads only fixed buffers (the cache method's `StaticDecode`, cache/static_decode.py): a
step fills them for its batch (one host-to-device copy), replays the graph, and commits
with `end_step`. Steps that are not decode only, have more sequences or longer ones than
any bucket, or run a cache method without a static form run eagerly, as before.

Without capture (the CPU, or `capture=False`), `run` executes the same static step
eagerly: what tests use to check that a padded, fixed-shape step gives the dynamic
step's logits, and the form a capture records.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.cache.static_decode import StaticDecode, is_decode_only
from kvforge.errors import require
from kvforge.models.causal_lm import CausalLM

log = logging.getLogger(__name__)

SMALLEST_CAPTURED_LENGTH = 512
DEFAULT_MAX_SEQ_LEN_TO_CAPTURE = 8192


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """start, 2 x start, ... below `limit`, then `limit` itself."""
    sizes = []
    size = start
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


@contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection inside the block, after one before it. A collection during a
    capture would run finalisers there (ShadowKV's store unregisters its page-locked memory,
    a call CUDA refuses while a stream captures), and capturing many graphs is faster
    without one (vLLM pauses it too)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class CaptureReport:
    graphs: int
    seconds: float
    bytes: int  # device memory the graphs' pool holds after capture


class DecodeGraphs:
    def __init__(self, model: CausalLM, cache: CacheMethod, max_num_seqs: int, max_seq_len_to_capture: int,
                 capture: bool) -> None:
        require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, "must be >= 1")
        require(max_seq_len_to_capture >= 2, "max_seq_len_to_capture", max_seq_len_to_capture, "must be >= 2")
        self.model, self.cache = model, cache
        self.row_buckets = powers_of_two_up_to(max_num_seqs)
        self.length_buckets = powers_of_two_up_to(max_seq_len_to_capture,
                                                  min(SMALLEST_CAPTURED_LENGTH, max_seq_len_to_capture))
        self.steps: dict[tuple[int, int], StaticDecode] = {}
        if model.decode_reads_nothing_on_host():
            for rows in self.row_buckets:
                for tokens in self.length_buckets:
                    step = cache.static_decode(rows, tokens)
                    if step is not None:  # (None: the method has no fixed step for such a bucket)
                        self.steps[rows, tokens] = step
        self.capture_enabled = capture and bool(self.steps)
        # (rows, tokens, form) -> (graph, its logits, the metadata it was captured with)
        self._graphs: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, StepMetadata]] = {}
        self.last_form: str | None = None  # the form of the last step run from fixed buffers

    @property
    def enabled(self) -> bool:
        """Whether any step can run from fixed buffers (the cache method has a static form
        and the model reads nothing on the host in a decode step)."""
        return bool(self.steps)

    def bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The smallest bucket that holds `batch`'s sequences and lengths, or None."""
        rows_at = bisect.bisect_left(self.row_buckets, len(batch.spans))
        longest = max(span.total_len for span in batch.spans)
        tokens_at = bisect.bisect_left(self.length_buckets, longest)
        if rows_at == len(self.row_buckets) or tokens_at == len(self.length_buckets):
            return None
        key = (self.row_buckets[rows_at], self.length_buckets[tokens_at])
        return key if key in self.steps else None

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [sequences, vocab] of a decode-only step run from its bucket's buffers (and
        its graph once captured), or None, having done nothing, when the step must run eagerly.
        `batch` holds host tensors."""
        if not is_decode_only(batch):
            return None
        key = self.bucket(batch)
        if key is None or not self.model.decode_reads_nothing_on_host():  # (early exit may be set later)
            return None
        step = self.steps[key]
        host_meta = step.load(batch)
        if host_meta is None:
            return None
        rows = len(batch.spans)
        form = self.last_form = step.form_of(host_meta)
        captured = self._graphs.get((*key, form))
        if captured is not None:
            graph, logits, meta = captured
            graph.replay()
            # the output buffer is overwritten by the next replay: the caller gets its own copy
            result = logits[:rows].clone()
        else:
            meta = step.make_meta(form)
            with torch.inference_mode():
                result = self.model.forward_step(self.cache, meta)[:rows]
        with torch.inference_mode():
            step.finish(host_meta, meta, rows)
            self.cache.end_step(host_meta)
        return result

    def capture(self) -> CaptureReport:
        """Capture every form of every bucket's step (largest first, so that smaller graphs
        reuse the pool's memory) on the current CUDA device; a no-op without capture enabled."""
        if not self.capture_enabled:
            return CaptureReport(0, 0.0, 0)
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = self._new_pool()
        with collection_paused():
            for key in sorted(self.steps, reverse=True):
                for form in self.steps[key].forms:
                    self._graphs[(*key, form)] = self._capture_one(self.steps[key], form, pool)
        self._wait_for_device()
        report = CaptureReport(len(self._graphs), time.perf_counter() - start, torch.cuda.memory_reserved() - before)
        log.info("captured %d decode graphs (rows %s x lengths %s) in %.1f s, %.1f MiB", report.graphs,
                 self.row_buckets, self.length_buckets, report.seconds, report.bytes / 2**20)
        return report

    def describe(self, report: CaptureReport) -> str:
        """The start-up line saying how decode steps run: from which graphs, at what capture
        cost, or why eagerly."""
        if not self.steps:
            why = ("the model reads device values on the host in a decode step (SwiftKV's early exit)"
                   if not self.model.decode_reads_nothing_on_host()
                   else self.cache.why_no_static_decode()
                   or f"no bucket up to {self.length_buckets[-1]} tokens (--max-seq-len-to-capture) fits "
                      f"the {type(self.cache).__name__} cache's fixed decode step")
            return f"decode steps run eagerly: {why}"
        if not report.graphs:
            return "decode steps run eagerly from fixed buffers (not captured)"
        forms = sorted({form for step in self.steps.values() for form in step.forms})
        shapes = f"sequences {self.row_buckets} x tokens {self.length_buckets}"
        if len(forms) > 1:
            shapes += f" x forms {forms}"
        return (f"decode steps replay {report.graphs} CUDA graphs ({shapes}), captured at start-up in {report.seconds:.1f} s, "
                f"{report.bytes / 2**20:.0f} MiB of graph memory; --enforce-eager runs every step eagerly")

    def _capture_one(self, step: StaticDecode, form: str, pool: object
                     ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, StepMetadata]:
        # The buffers hold padding only (every row writes the scratch page), so warm-up and
        # capture change nothing a sequence reads. The warm-up (lazy inits, kernel
        # compiles) runs on metadata of its own: what a step derives and caches on its
        # metadata must be computed inside the capture, so that each replay recomputes it.
        meta = step.make_meta(form)
        self._warm_up(lambda: self.model.forward_step(self.cache, step.make_meta(form)))
        graph, logits = self._record(lambda: self.model.forward_step(self.cache, meta), pool)
        return graph, logits, meta

    def _new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def _wait_for_device(self) -> None:
        torch.cuda.synchronize()

    def _warm_up(self, forward: Callable[[], torch.Tensor]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, forward: Callable[[], torch.Tensor], pool: object
                ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            logits = forward()
        return graph, logits
