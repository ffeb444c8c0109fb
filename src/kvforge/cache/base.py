"""The cache-method interface: how K/V are stored and how attention reads them.

The model computes Q (with RoPE), pre-RoPE K and V, then for each layer calls
`write(cache_layer, batch, k_pre, v, rope)` followed by `attend(cache_layer, batch, q, rope)`.
A method decides the storage (full precision, quantised, low-rank + offloaded) and the
attention over it. New methods register with `@register_cache_method` and never touch
model files.

Step protocol (the model drives it):
  begin_step(batch) -> [write(l), attend(l)] for each model layer -> end_step(batch)
`write` for a cache layer happens before any `attend` that reads it in the same step.
Several model layers may attend to one cache layer (AcrossKV); only one writes it.

Memory protocol (the scheduler drives it): before a step, `allocate(seq, n)` makes room
for the step that brings `seq` to `n` tokens (all-or-nothing, False if it does not fit);
`free(seq)` returns everything. `memory_usage()` reports bytes per tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.layout import CacheLayout
from kvforge.errors import ConfigError
from kvforge.rope import PositionedRope


class CacheMethod(ABC):
    name: ClassVar[str]

    def __init__(self, layout: CacheLayout, compute_dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)

    # -- memory accounting ------------------------------------------------------------
    @abstractmethod
    def bytes_per_token(self, cache_layer: int) -> float:
        """Bytes one stored token costs in one cache layer (K and V, all KV heads)."""

    def kv_bytes_per_token(self) -> float:
        """Bytes one token costs over all cache layers, ignoring sliding-window bounds."""
        return sum(self.bytes_per_token(layer) for layer in range(self.layout.num_cache_layers))

    @abstractmethod
    def sequence_bytes(self, num_tokens: int) -> int:
        """Bytes a sequence of `num_tokens` tokens holds at most (windows bound it)."""

    def fits_together(self, token_counts: Sequence[int]) -> bool:
        """Whether sequences of these lengths fit the cache at once, each holding at most what
        `sequence_bytes` says (reserving admission; a prompt that fits nowhere is refused).
        Methods whose budget is split between stores check every store."""
        return sum(self.sequence_bytes(n) for n in token_counts) <= self.memory_capacity()["fast"]

    @abstractmethod
    def memory_usage(self) -> dict[str, int]:
        """Bytes in use per storage tier, e.g. {"fast": ..., "slow": ...}."""

    @abstractmethod
    def memory_capacity(self) -> dict[str, int]:
        """Bytes available per storage tier (the budget)."""

    def statistics(self) -> dict[str, float]:
        """Method-specific counters (hit rates, compression ratios, ...)."""
        return {}

    # -- sequences --------------------------------------------------------------------
    @abstractmethod
    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Whether `allocate(seq_id, num_tokens)` would succeed now."""

    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for the step that brings `seq_id` to `num_tokens` tokens."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything the sequence holds; unknown ids are ignored."""

    @abstractmethod
    def num_cached_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence the cache accounts for (0 if unknown)."""

    # -- one forward step -------------------------------------------------------------
    def begin_step(self, batch: ForwardBatch) -> None:
        """Check the batch against the cache state and prepare per-step metadata."""
        for span in batch.spans:
            have = self.num_cached_tokens(span.seq_id)
            if have != span.cached_len:
                raise ConfigError("cached_len", span.cached_len,
                                  f"sequence {span.seq_id} has {have} cached tokens")

    @abstractmethod
    def write(self, cache_layer: int, batch: ForwardBatch, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        """Store the step's keys (before RoPE) and values [T, kv_heads, head_dim]."""

    @abstractmethod
    def attend(self, cache_layer: int, batch: ForwardBatch, q: torch.Tensor,
               rope: PositionedRope) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for the step's queries (RoPE applied).
        Each query sees the sequence's earlier tokens and the step's own tokens up to it."""

    def fused_decode_target(self, cache_layer: int) -> tuple | None:
        """What a fused decoder-layer op needs to store and attend this step's K/V itself
        (kernels/cpu_decode_layer.py), or None when the method offers no such path (the
        default) or not for this step: the layer then calls `write` and `attend`."""
        return None

    def attend_rows(self, cache_layer: int, batch: ForwardBatch, q: torch.Tensor, rope: PositionedRope,
                    rows: torch.Tensor) -> torch.Tensor:
        """Attention for a subset of the step's query rows (`rows` [R] into the batch, q
        [R, heads, head_dim]); each query sees exactly what `attend` would show it. Used
        by SwiftKV's later layers, which compute queries only for the logit rows.

        This generic version runs `attend` with zero queries elsewhere and keeps the
        requested rows (correct for any method, but it pays for every row); methods
        override it to attend for the requested rows only."""
        full = q.new_zeros((batch.num_tokens, *q.shape[1:]))
        full[rows] = q
        return self.attend(cache_layer, batch, full, rope)[rows]

    @abstractmethod
    def end_step(self, batch: ForwardBatch) -> None:
        """Commit the step: sequences now hold `span.total_len` tokens."""

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


class PagedPoolMemory:
    """Memory accounting of methods whose whole storage is pages of one block pool on the
    fast tier (`full`): usage and capacity are page counts times `page_bytes`."""

    pages: Any  # kvforge.cache.page_table.PageTable
    page_bytes: int

    def memory_usage(self) -> dict[str, int]:
        return {"fast": self.pages.pool.num_used * self.page_bytes, "slow": 0}

    def memory_capacity(self) -> dict[str, int]:
        return {"fast": self.pages.pool.num_blocks * self.page_bytes, "slow": 0}

