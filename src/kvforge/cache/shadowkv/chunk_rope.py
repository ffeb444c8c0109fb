"""RoPE of rebuilt ShadowKV chunks (sparse.py): rebuilt keys are pre-RoPE (coefficients x
basis) and are rotated at their chunk's positions from tables computed once per rotary
embedding."""

from __future__ import annotations

import torch

from kvforge.rope import PositionedRope, rotate_half


class ChunkRope:
    """RoPE of whole chunks from cos/sin tables [chunks, chunk, D] computed once per rotary
    embedding (grown on demand) instead of per rebuilt row and step."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._tables: dict[int, tuple[object, torch.Tensor, torch.Tensor]] = {}
        # Tables replaced by larger ones stay allocated: a captured decode step (CUDA graph)
        # reads the tables it was captured with at their addresses.
        self._replaced: list[tuple[object, torch.Tensor, torch.Tensor]] = []

    def tables(self, rope: PositionedRope, num_chunks: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [S, chunk, D] of positions 0 .. S x chunk - 1, S >= num_chunks."""
        rotary = rope.rotary
        entry = self._tables.get(id(rotary))
        if entry is None or entry[1].shape[0] < num_chunks or entry[1].dtype != dtype:
            size = max(num_chunks, 2 * entry[1].shape[0]) if entry is not None else num_chunks
            positions = torch.arange(size * self.chunk, device=device)
            cos, sin = rotary.cos_sin(positions, dtype)
            if entry is not None:
                self._replaced.append(entry)
            # the rotary is kept in the entry, so its id cannot be reused while cached
            entry = (rotary, cos.view(size, self.chunk, -1), sin.view(size, self.chunk, -1))
            self._tables[id(rotary)] = entry
        return entry[1], entry[2]

    def apply(self, keys: torch.Tensor, chunks: torch.Tensor, rope: PositionedRope, num_chunks: int) -> torch.Tensor:
        """keys [M, chunk, D] of chunk ids [M] (all < num_chunks), rotated at their positions."""
        cos, sin = self.tables(rope, num_chunks, keys.dtype, keys.device)
        cos, sin = cos.index_select(0, chunks), sin.index_select(0, chunks)
        return keys * cos + rotate_half(keys) * sin
