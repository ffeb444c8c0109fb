"""How a `shadowkv` sequence changes form at the end of a step: compression (exact pages of
every global layer -> chunk pages, coefficients and an exact tail) and folding (the oldest
whole chunks of a compressed sequence's exact tail -> chunk pages). A mixin of
`ShadowKVCache` (method.py), which owns the state it reads; both run from `end_step`, after
the step's attention, with the reservations `allocate` made (allocator.py).
"""

from __future__ import annotations

import torch

from kvforge.batch import SequenceSpan
from kvforge.cache.layout import CacheLayout
from kvforge.cache.shadowkv.allocator import ShadowKVAllocator
from kvforge.cache.shadowkv.compress import append_coefficients, compress_layer, fold_chunks
from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.state import CompressedSequence, buffer_rows, grown_capacity
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.step import ShadowKVStepMetadata
from kvforge.step_plan import upload


class ShadowKVTransitions(ShadowKVAllocator):
    """Compression and folding of `ShadowKVCache`; the attributes below are set by its constructor."""

    layout: CacheLayout
    config: ShadowKVConfig
    compute_dtype: torch.dtype
    device: torch.device
    coefficient_dtype: torch.dtype
    global_layers: list[int]
    stats: ShadowKVStats
    _inner_index: dict[int, int]

    def _compress(self, span: SequenceSpan, meta: ShadowKVStepMetadata) -> None:
        """Compress every global layer of a sequence from its exact pages (committed, this
        step's tokens included), then free the pages."""
        assert self.exact is not None and self.store is not None
        seq = self._seqs[span.seq_id]
        reservation = seq.reservation
        assert reservation is not None and reservation.compress and seq.compressed is None
        config, chunk = self.config, self.config.chunk
        n = span.total_len
        sizes = self.memory.sizes
        prefix = sizes.compressed_chunks(n) * chunk
        # The reservation's pages and fixed bytes now belong to the compressed state (the
        # bytes its actual ranks leave unused are returned below).
        pages = self._take_pages(reservation, reservation.pages)
        fixed, reservation.fixed_bytes = reservation.fixed_bytes, 0
        outliers = min(config.outliers, len(pages))
        chunks_per_step = config.budget_tokens(n, self.layout.num_kv_heads) // chunk
        state = CompressedSequence(
            pages=pages, page_table=torch.tensor(pages, dtype=torch.long, device=self.device),
            window=n - prefix, chunks_per_step=chunks_per_step, num_outliers=outliers,
            slots_start=buffer_rows(outliers, chunk, config.window_capacity, chunks_per_step)[0],
            fixed_bytes=fixed, layers=[None] * len(self.global_layers))
        with self.stats.timed("compress"):
            for index in range(len(self.global_layers)):
                group, slot = self.exact.groups.slot_of[index]
                table = torch.tensor(self.exact.pages.require_slots(span.seq_id, group, 0, n), dtype=torch.long,
                                     device=self.device)
                keys = self.exact.k_store[slot].index_select(1, table).flatten(1, 2)[:, :n].to(self.compute_dtype)
                values = self.exact.v_store[slot].index_select(1, table).flatten(1, 2)[:, :n].to(self.compute_dtype)
                cache_layer = self.global_layers[index]
                layer_rank = config.rank_rule(meta.queries.sample(cache_layer, span.seq_id),
                                              self.layout.specs[cache_layer].scale)
                layer, data = compress_layer(keys, values, meta.layer_ropes[index], prefix, layer_rank, chunk,
                                             config.outliers, config.window_capacity, chunks_per_step,
                                             self.coefficient_dtype)
                self.store.write(index, state.page_table, data.landmarks, data.values)
                state.layers[index] = layer
                state.ranks.append(layer.basis.shape[0])
        state.fixed_bytes = sizes.fixed_state_bytes(n, len(pages), state.ranks)
        assert state.fixed_bytes <= fixed, "compression reserved the largest rank"
        self._fixed_bytes -= fixed - state.fixed_bytes
        self.stats.record_ranks(state.ranks)
        seq.compressed = state
        self.exact.free(span.seq_id)
        self.stats.compressions += 1

    def _append(self, span: SequenceSpan, meta: ShadowKVStepMetadata, in_buffer: bool) -> None:
        """Add a compressed sequence's step tokens to its exact tail (a decode token is
        already in the buffers: `write` put it there); fold whole chunks out of the tail
        once it holds more than local + generated_window tokens."""
        assert self.store is not None
        seq = self._seqs[span.seq_id]
        state = seq.compressed
        reservation = seq.reservation
        assert state is not None and reservation is not None
        chunk = self.config.chunk
        grown = state.window + span.query_len
        folds = self.memory.sizes.fold_count(grown)
        assert folds == reservation.pages, "allocate reserved the pages of this fold"
        taken = self._take_pages(reservation, folds)
        # The reserved growth of the coefficient storage (if any) now belongs to the state.
        state.fixed_bytes += reservation.fixed_bytes
        reservation.fixed_bytes = 0
        start = state.window_start(chunk)
        rows = slice(span.query_start, span.query_end)
        new_pages = upload(torch.tensor(taken, dtype=torch.long), self.device)
        moved = folds * chunk
        capacity = grown_capacity(state.coefficient_capacity, state.num_chunks + folds)
        for cache_layer, index in ((c, self._inner_index[c]) for c in self.global_layers):
            layer = state.layers[index]
            assert layer is not None
            if in_buffer:
                tail_keys = layer.keys[:, start:start + grown]
                tail_values = layer.values[:, start:start + grown]
            else:
                k_post, v = meta.step_kv[cache_layer]
                new_keys, new_values = k_post[rows].transpose(0, 1), v[rows].transpose(0, 1)
                if not folds:
                    layer.keys[:, start + state.window:start + grown] = new_keys
                    layer.values[:, start + state.window:start + grown] = new_values
                    continue
                tail_keys = torch.cat((layer.keys[:, start:start + state.window], new_keys), dim=1)
                tail_values = torch.cat((layer.values[:, start:start + state.window], new_values), dim=1)
            if not folds:
                continue
            with self.stats.timed("fold"):
                data = fold_chunks(tail_keys[:, :moved], tail_values[:, :moved], state.num_chunks * chunk,
                                   layer.basis, meta.layer_ropes[index], chunk)
                self.store.write(index, new_pages, data.landmarks, data.values)
                append_coefficients(layer, state.num_chunks, data.coefficients, capacity)
                rest_keys, rest_values = tail_keys[:, moved:].clone(), tail_values[:, moved:].clone()
                layer.keys[:, start:start + grown - moved] = rest_keys
                layer.values[:, start:start + grown - moved] = rest_values
                layer.candidates = torch.cat((layer.candidates, layer.candidates.new_ones(
                    (layer.candidates.shape[0], folds))), dim=1)  # folded chunks are never outliers
        if folds:
            state.extend(taken, new_pages)
            self.stats.folded_chunks += folds
        state.window = grown - moved
