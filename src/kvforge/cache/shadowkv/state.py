"""Per-sequence state of a compressed ShadowKV sequence (global cache layers only).

A sequence of n tokens compressed with prefix length p = C x chunk holds:
- chunk pages for the prefix (store.py): low-rank key coefficients and landmarks
  on the fast tier, values on the slow tier;
- per global layer (`LayerState`, fast tier, fixed size for the sequence's life): the
  basis B [r, W] of its low-rank keys, the outlier chunk ids per KV head [H, O], and one
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
chunks); chunk contents never change once written, so a reused chunk is always current.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ID_BYTES = 8  # int64 chunk ids


@dataclass
class LayerState:
    basis: torch.Tensor  # [r, W]
    outliers: torch.Tensor  # [H, O] chunk ids
    keys: torch.Tensor  # [H, R, D] post-RoPE
    values: torch.Tensor  # [H, R, D]
    slot_ids: torch.Tensor  # [H, k] chunk held by each reuse slot, -1: empty
    candidates: torch.Tensor  # [H, C] bool: selectable chunks (every chunk but the outliers)


@dataclass
class CompressedSequence:
    pages: list[int]  # chunk page of each prefix chunk
    page_table: torch.Tensor  # the same as a tensor on the compute device
    window: int  # exact tail tokens
    chunks_per_step: int  # k: chunks selected per KV head (budget / chunk)
    num_outliers: int  # O: outlier chunks per KV head and layer
    slots_start: int  # first row of the reuse slots in the buffers (= O x chunk)
    fixed_bytes: int  # fast-tier bytes of the per-layer state (accounted at compression)
    layers: list[LayerState | None] = field(default_factory=list)
    # pages[0] when the pages are one run of consecutive ids (lets a step read landmarks
    # in place, see ChunkStore.gather_landmarks), else None
    run_start: int | None = None

    def __post_init__(self) -> None:
        self.run_start = self.pages[0] if self.pages and _is_run(self.pages, self.pages[0]) else None

    @property
    def num_chunks(self) -> int:
        return len(self.pages)

    def extend(self, pages: list[int], table: torch.Tensor) -> None:
        """Append chunk pages (folding) and their tensor."""
        if self.run_start is not None and not _is_run(pages, self.run_start + len(self.pages)):
            self.run_start = None
        self.pages.extend(pages)
        self.page_table = torch.cat((self.page_table, table))

    def window_start(self, chunk: int) -> int:
        return self.slots_start + self.chunks_per_step * chunk


def _is_run(pages: list[int], first: int) -> bool:
    return pages == list(range(first, first + len(pages)))


def buffer_rows(outliers: int, chunk: int, window_capacity: int, chunks_per_step: int) -> tuple[int, int, int]:
    """(slots_start, window_start, R) of the exact buffers."""
    slots_start = outliers * chunk
    window_start = slots_start + chunks_per_step * chunk
    return slots_start, window_start, window_start + window_capacity + 1


def fixed_state_bytes(num_layers: int, kv_heads: int, head_dim: int, rank: int, chunk: int, outliers: int,
                      window_capacity: int, chunks_per_step: int, element: int) -> int:
    """Fast-tier bytes of `num_layers` LayerStates: basis, K and V buffers, chunk ids."""
    _, _, rows = buffer_rows(outliers, chunk, window_capacity, chunks_per_step)
    per_layer = (rank * kv_heads * head_dim + 2 * kv_heads * rows * head_dim) * element
    per_layer += kv_heads * (outliers + chunks_per_step) * ID_BYTES
    return num_layers * per_layer
