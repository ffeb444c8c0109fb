"""The cache-method interface: how K/V are stored and how attention reads them.

The model computes Q (with RoPE), pre-RoPE K and V; a cache method decides the storage
(full precision, quantised, low-rank + offloaded) and the attention over it. New methods
register with `@register_cache_method` (registry.py) and never touch model files.

A method plays four roles, as an attention backend does in vLLM v1:
- **memory** (`cache.memory`, a `MemorySpec`, memory.py): what storage costs, declared at
  construction; admission and the scheduler's reservations read only this;
- **allocator** (`allocate`, `free`, `num_cached_tokens`, `memory_usage`, and the optional
  prefix-sharing and forking capabilities): driven by the scheduler, once per step;
- **step metadata** (`begin_step(batch)` -> the method's `StepMetadata` subclass): built
  once per step, in one place, from the batch and the allocator's tables; every layer's
  `write` / `attend`, `end_step` and the fused decode op read that one object;
- **attention** (`write`, `attend`, `attend_rows`, per layer).

Step protocol (the model drives it):
  meta = begin_step(batch) -> [write(l, meta), attend(l, meta)] for each model layer -> end_step(meta)
`write` for a cache layer happens before any `attend` that reads it in the same step.
Several model layers may attend to one cache layer (AcrossKV); only one writes it.

Memory protocol (the scheduler drives it): before a step, `allocate(seq, n)` makes room
for the step that brings `seq` to `n` tokens (all-or-nothing, False if it does not fit);
`free(seq)` returns everything. `memory_usage()` reports bytes per tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Generic

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.layout import CacheLayout
from kvforge.cache.memory import MemorySpec
from kvforge.cache.static_decode import StaticDecode
from kvforge.cache.step_metadata import Meta, StepMetadata
from kvforge.errors import ConfigError
from kvforge.rope import PositionedRope

__all__ = ["CacheMethod", "FusedDecodeTarget", "Meta", "StepMetadata"]

if TYPE_CHECKING:
    from kvforge.kernels.cpu_decode_layer import DecodeLayerRun


class FusedDecodeTarget(ABC):
    """What a fused decode-layers op (kernels/cpu_decode_layer.py) needs of one cache layer
    in a decode-only step, offered by a method that opts in through `fused_decode_target`.

    `plan` holds the step's plan tensors of the layer's group (the same objects for every
    layer of the group) and `settings` the kernel's scalar settings; layers whose targets
    `join` the first one's run in one op call. The op does exactly what the layers' `write`
    and `attend` would (bitwise: the kernels' parity tests decide)."""

    plan: tuple[torch.Tensor, ...]
    settings: tuple[float | int, ...]

    def joins(self, first: FusedDecodeTarget) -> bool:
        """Whether this layer can run in the op call that `first` (the run's first layer) starts."""
        return (type(self) is type(first) and self.settings == first.settings
                and len(self.plan) == len(first.plan) and all(a is b for a, b in zip(self.plan, first.plan)))

    @classmethod
    @abstractmethod
    def run_layers(cls, targets: Sequence[FusedDecodeTarget], hidden: torch.Tensor,
                   layers: DecodeLayerRun) -> torch.Tensor:
        """Run the fused op over consecutive layers (`layers`: their weights and shape,
        `targets`: their cache layers, each joining the first) and return their output."""

    def given_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's K/V of this cache layer when they are already stored (SwiftKV's later
        layers: the model's fused K/V GEMM wrote them) and `run_layers_given_kv` reads them;
        None (the default: the method has no such run, or nothing was written yet)."""
        return None

    @classmethod
    def run_layers_given_kv(cls, targets: Sequence[FusedDecodeTarget], hidden: torch.Tensor,
                            layers: DecodeLayerRun) -> torch.Tensor:
        """Like `run_layers`, for layers that neither project nor store K/V: each attends over
        its cache layer with the step's `given_kv` (every target has them), as `attend_rows`
        would for all of a decode-only step's rows."""
        raise NotImplementedError(f"{cls.__name__} runs no layers on given K/V (its given_kv is None)")


class CacheMethod(ABC, Generic[Meta]):
    name: ClassVar[str]
    memory: MemorySpec

    def __init__(self, layout: CacheLayout, compute_dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)

    # -- allocator --------------------------------------------------------------------
    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for the step that brings `seq_id` to `num_tokens` tokens."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything the sequence holds; unknown ids are ignored."""

    @abstractmethod
    def num_cached_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence the cache accounts for (0 if unknown)."""

    @abstractmethod
    def memory_usage(self) -> dict[str, int]:
        """Bytes in use per storage tier, e.g. {"fast": ..., "slow": ...}."""

    def start_up_line(self) -> str | None:
        """What the method did at start-up that a user should hear of (LLM.start_up_lines),
        or None."""
        return None

    def statistics(self) -> dict[str, float]:
        """Method-specific counters (hit rates, compression ratios, ...)."""
        return {}

    # -- one forward step -------------------------------------------------------------
    @abstractmethod
    def begin_step(self, batch: ForwardBatch) -> Meta:
        """The step's metadata: checks the batch against the cache state (`check_batch`) and
        plans the step once for every layer."""

    def check_batch(self, batch: ForwardBatch) -> None:
        """Every span must start where the cache's copy of its sequence ends."""
        for span in batch.spans:
            have = self.num_cached_tokens(span.seq_id)
            if have != span.cached_len:
                raise ConfigError("cached_len", span.cached_len,
                                  f"sequence {span.seq_id} has {have} cached tokens")

    @abstractmethod
    def write(self, cache_layer: int, meta: Meta, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        """Store the step's keys (before RoPE) and values [T, kv_heads, head_dim]."""

    @abstractmethod
    def attend(self, cache_layer: int, meta: Meta, q: torch.Tensor, rope: PositionedRope) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for the step's queries (RoPE applied).
        Each query sees the sequence's earlier tokens and the step's own tokens up to it."""

    def attend_rows(self, cache_layer: int, meta: Meta, q: torch.Tensor, rope: PositionedRope,
                    rows: torch.Tensor) -> torch.Tensor:
        """Attention for a subset of the step's query rows (`rows` [R] into the batch, q
        [R, heads, head_dim]); each query sees exactly what `attend` would show it. Used
        by SwiftKV's later layers, which compute queries only for the logit rows.

        This generic version runs `attend` with zero queries elsewhere and keeps the
        requested rows (correct for any method, but it pays for every row); methods
        override it to attend for the requested rows only."""
        full = q.new_zeros((meta.batch.num_tokens, *q.shape[1:]))
        full[rows] = q
        return self.attend(cache_layer, meta, full, rope)[rows]

    @abstractmethod
    def end_step(self, meta: Meta) -> None:
        """Commit the step: sequences now hold `span.total_len` tokens."""

    def fused_decode_target(self, cache_layer: int, meta: Meta) -> FusedDecodeTarget | None:
        """This layer's `FusedDecodeTarget` for the step, or None (the default: the method
        offers no fused path, or not for this step), and the layer then calls `write` and
        `attend`. A method opts in by overriding this; a subclass that changes what `write`
        or `attend` compute must return None here."""
        return None

    # -- static decode steps (engine/decode_graphs.py: what CUDA graphs capture) ----------
    def static_decode(self, rows: int, max_tokens: int) -> StaticDecode[Meta] | None:
        """Fixed buffers for decode-only steps of at most `rows` sequences of at most
        `max_tokens` tokens (cache/static_decode.py), or None (the default: the method runs
        every step eagerly)."""
        del rows, max_tokens
        return None

    def why_no_static_decode(self) -> str:
        """Why `static_decode` gives None (said in the engine's start-up line)."""
        return f"the {type(self).__name__} cache has no fixed-shape decode step"

    # -- prefix caching (engine.prefix_cache drives it) ----------------------------------
    # Page sharing: methods whose stored pages are final once full set `prefix_block_size`
    # (tokens per page) and implement match_prefix / publish_prefix. Other methods keep
    # it None; the engine can still continue a finished sequence (a conversation's next
    # turn) because every method can keep a sequence alive after its request ends.
    prefix_block_size: int | None = None

    def match_prefix(self, seq_id: int, page_keys: Sequence[bytes], max_tokens: int) -> int:
        """Start the new sequence `seq_id` with the longest run of cached pages under
        `page_keys` (page j: tokens [j x block, (j + 1) x block)) covering at most
        `max_tokens` tokens; returns the tokens it now holds (0: none)."""
        return 0

    def publish_prefix(self, seq_id: int, page_keys: Sequence[bytes]) -> None:
        """Offer the sequence's full, committed pages for reuse under their keys."""
        del seq_id, page_keys  # a method without page sharing has nothing to offer

    def forget_prefixes(self) -> None:
        """Drop every cached page no sequence uses (benchmarks start each repeat cold)."""
        return None  # a method without page sharing caches no page

    # Snapshots: a method whose stored state depends on where prefill chunks began (KIVI:
    # a chunk attends earlier chunks through their quantised pages) sets `can_fork` and
    # implements `fork`. The engine then keeps a snapshot of a prompt's state at the start
    # of its last prefill chunk, and a later prompt that extends those tokens starts from a
    # fork of it: the same state the no-cache run reaches at that chunk boundary.
    can_fork: bool = False

    def fork(self, source: int, target: int) -> bool:
        """Start the new sequence `target` in the state of `source` (which goes on
        unchanged); False, changing nothing, if memory for it cannot be had now."""
        raise NotImplementedError(f"{type(self).__name__} cannot fork sequences")
