"""Per-sequence state of a compressed ShadowKV sequence (global cache layers only).

A sequence of n tokens compressed with prefix length p = C x chunk holds:
- chunk pages for the prefix (store.py): landmarks on the fast tier, values on the slow
  tier;
- per global layer (`LayerState`, fast tier): the basis B [r, W] of its low-rank keys
  (r chosen per layer and sequence with rank=auto), the coefficients A [capacity, chunk, r]
  of its chunks in logical order (chunk j at row j; the capacity is the chunk count at
  compression and grows by an eighth when a fold outgrows it, see `grown_capacity`; every
  other part has a fixed size for the sequence's life), the outlier chunk ids per KV head
  [H, O], and one
  exact buffer for K (post-RoPE) and one for V, [H, R, D], whose rows are
      [0, O x chunk)                      the outlier chunks' tokens,
      [slots_start, slots_start + k x chunk)
                                          k reuse slots of `chunk` rows: the chunks the
                                          last step selected, reconstructed, with their
                                          ids in `slot_ids` [H, k] (-1: empty),
      [window_start, window_start + window)
                                          the exact tail, positions p .. n - 1 (local
                                          window at compression, then generated tokens
                                          until they are folded into chunk pages),
      ... up to R                         room for the tail to grow (window capacity + 1:
                                          a decode token is written before folding).
  Attention of a decode step reads the rows in use, [0, window_start + window], with a
  mask over the slots, so a chunk reused from the previous step is never copied.

Invariants: the window holds the tokens [p, n) in order; p only grows (by folding whole
chunks); chunk contents never change once written, so a reused chunk is always current;
a layer's basis and coefficients share one rank for the sequence's life (folded chunks
project onto the basis chosen at compression).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ID_BYTES = 8  # int64 chunk ids


@dataclass
class LayerState:
    basis: torch.Tensor  # [r, W]
    coefficients: torch.Tensor  # [capacity, chunk, r]: chunk j's low-rank keys at row j (storage dtype)
    outliers: torch.Tensor  # [H, O] chunk ids
    keys: torch.Tensor  # [H, R, D] post-RoPE
    values: torch.Tensor  # [H, R, D]
    slot_ids: torch.Tensor  # [H, k] chunk held by each reuse slot, -1: empty
    candidates: torch.Tensor  # [H, C] bool: selectable chunks (every chunk but the outliers)

    def __setattr__(self, name: str, value: object) -> None:
        # Replacing any tensor (a fold grows the coefficients and candidates) drops what a
        # kernel derived from their addresses (`kernel_view`).
        object.__setattr__(self, name, value)
        if name not in ("kernel_view", "_kernel_view"):
            object.__setattr__(self, "_kernel_view", None)

    def __getstate__(self) -> dict[str, object]:
        # a copy's tensors live elsewhere: it derives its own view
        return {**self.__dict__, "_kernel_view": None}

    @property
    def kernel_view(self) -> object | None:
        """What a kernel derived from these tensors' addresses and sizes (pointer_table.py's
        row), kept until a tensor is replaced; None: derive it again."""
        return getattr(self, "_kernel_view", None)

    @kernel_view.setter
    def kernel_view(self, view: object) -> None:
        object.__setattr__(self, "_kernel_view", view)


@dataclass
class CompressedSequence:
    pages: list[int]  # chunk page of each prefix chunk
    page_table: torch.Tensor  # the same as a tensor on the compute device
    window: int  # exact tail tokens
    chunks_per_step: int  # k: chunks selected per KV head (budget / chunk)
    num_outliers: int  # O: outlier chunks per KV head and layer
    slots_start: int  # first row of the reuse slots in the buffers (= O x chunk)
    fixed_bytes: int  # fast-tier bytes of the per-layer state, coefficients included
    ranks: list[int] = field(default_factory=list)  # per global layer
    layers: list[LayerState | None] = field(default_factory=list)
    # pages[0] when the pages are one run of consecutive ids (lets a step read landmarks
    # in place, see ChunkStore.gather_landmarks), else None
    run_start: int | None = None
    _pages_host: torch.Tensor | None = field(default=None, repr=False)  # `pages` as a host tensor

    def __post_init__(self) -> None:
        self.run_start = self.pages[0] if self.pages and _is_run(self.pages, self.pages[0]) else None

    @property
    def coefficient_capacity(self) -> int:
        """Chunks each layer's coefficient storage holds (the same in every layer)."""
        first = self.layers[0]
        assert first is not None, "compressed"
        return first.coefficients.shape[0]

    @property
    def num_chunks(self) -> int:
        return len(self.pages)

    def extend(self, pages: list[int], table: torch.Tensor) -> None:
        """Append chunk pages (folding) and their tensor."""
        if self.run_start is not None and not _is_run(pages, self.run_start + len(self.pages)):
            self.run_start = None
        self.pages.extend(pages)
        self.page_table = torch.cat((self.page_table, table))

    def pages_host(self) -> torch.Tensor:
        """`pages` as a host int64 tensor, made again only when folds have appended pages."""
        if self._pages_host is None or self._pages_host.numel() != len(self.pages):
            self._pages_host = torch.tensor(self.pages, dtype=torch.long)
        return self._pages_host

    def window_start(self, chunk: int) -> int:
        return self.slots_start + self.chunks_per_step * chunk


def padded_page_tables(states: Sequence[CompressedSequence], rows: int, width: int) -> torch.Tensor:
    """Host [rows, width] int64: row b the chunk pages of states[b], padded with page 0
    (never a candidate), then rows of page 0."""
    table = torch.zeros((rows, width), dtype=torch.long)
    for b, state in enumerate(states):
        table[b, :state.num_chunks] = state.pages_host()
    return table


def _is_run(pages: list[int], first: int) -> bool:
    return pages == list(range(first, first + len(pages)))


def buffer_rows(outliers: int, chunk: int, window_capacity: int, chunks_per_step: int) -> tuple[int, int, int]:
    """(slots_start, window_start, R) of the exact buffers."""
    slots_start = outliers * chunk
    window_start = slots_start + chunks_per_step * chunk
    return slots_start, window_start, window_start + window_capacity + 1


def grown_capacity(capacity: int, needed: int) -> int:
    """Coefficient capacity (chunks) after a fold that needs `needed` chunks: unchanged if
    they fit, else grown by at least an eighth, so a long generation copies a layer's
    coefficients O(log) times and wastes at most an eighth of them."""
    return capacity if needed <= capacity else max(needed, capacity + math.ceil(capacity / 8))


def coefficient_bytes(ranks: Sequence[int], chunk: int, num_chunks: int, coefficient_element: int) -> int:
    """Bytes of `num_chunks` chunks of coefficients in layers of `ranks`."""
    return num_chunks * chunk * sum(ranks) * coefficient_element


def fixed_state_bytes(ranks: Sequence[int], kv_heads: int, head_dim: int, chunk: int, outliers: int,
                      window_capacity: int, chunks_per_step: int, num_chunks: int, element: int,
                      coefficient_element: int) -> int:
    """Fast-tier bytes of one LayerState per rank in `ranks` right after compression into
    `num_chunks` chunk pages: basis, coefficients (`coefficient_element` bytes each), K and V
    buffers, chunk ids."""
    _, _, rows = buffer_rows(outliers, chunk, window_capacity, chunks_per_step)
    per_layer = 2 * kv_heads * rows * head_dim * element + kv_heads * (outliers + chunks_per_step) * ID_BYTES
    bases = sum(ranks) * kv_heads * head_dim * element
    return len(ranks) * per_layer + bases + coefficient_bytes(ranks, chunk, num_chunks, coefficient_element)
