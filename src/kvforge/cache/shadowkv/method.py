"""The `shadowkv` cache method (Sun et al., ByteDance Seed): low-rank pre-RoPE keys,
values on a slow tier, landmark-based sparse attention with chunk reuse at decode.

Life of a sequence (global cache layers; sliding-window layers always keep their exact
window in a `full` cache of their own):
- *exact* while it is prefilled: K/V live in an inner `full` cache (paged, exact
  attention for prefill chunks and decode tokens alike);
- *compressed* at the end of the first step that leaves it with n >= min_context tokens
  and whose span ends with a logit row: the last chunk of a prompt (the engine asks logits
  there), or a decode token. That step still attends exactly; `end_step` then compresses
  every global layer (compress.py) from the inner pages and frees them. So, as
  in the paper, compression is part of the prefill: decode never pays for it. The prefix
  [0, p), p = (n // chunk) x chunk - local, becomes chunk pages (coefficients and
  landmarks fast, values slow); the tail [p, n) stays exact. Sequences that never reach
  min_context stay exact; prompt chunks without logits never compress;
- *decoding compressed*: every step attends over outliers + top-k chunks + exact window
  + its own tokens (sparse.py); `end_step` appends the step's tokens to the
  window and, once it holds more than local + generated_window tokens, folds just enough
  of its oldest whole chunks into chunk pages to get back under that bound (ShadowKV+).
  A multi-token span of a compressed sequence selects once for all its queries (scores
  summed over them) and is causal within itself.

Memory accounting (bytes per token and sequence, reservations, tier usage) is the
`ShadowKVMemory` mixin in memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.base import CacheMethod
from kvforge.cache.full.method import FullCache, FullCacheConfig
from kvforge.cache.layout import CacheLayout
from kvforge.cache.registry import register_cache_method
from kvforge.cache.shadowkv.compress import append_coefficients, compress_layer, fold_chunks
from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.memory import SequenceEntry, ShadowKVMemory, chunk_page_bytes
from kvforge.cache.shadowkv.query_samples import QuerySampler
from kvforge.cache.shadowkv.sparse import SparseAttention, SparseGroup
from kvforge.cache.shadowkv.split import BudgetSplit
from kvforge.cache.shadowkv.state import CompressedSequence, buffer_rows, grown_capacity
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.store import ChunkStore
from kvforge.cache.shadowkv.threads import cpu_threads
from kvforge.errors import ConfigError
from kvforge.rope import PositionedRope
from kvforge.step_plan import upload


@dataclass
class _Step:
    exact_batch: ForwardBatch | None  # spans of exact sequences (renumbered rows)
    exact_rows: torch.Tensor | None  # their rows in the batch (None: every row)
    compressing: tuple[SequenceSpan, ...]
    compressed_spans: tuple[SequenceSpan, ...]
    groups: tuple[SparseGroup, ...]
    any_compressed: bool
    ropes: dict[int, PositionedRope] = field(default_factory=dict)  # sub-ropes of exact rows
    # attend_rows of a mixed step: the rows asked for and where they go (None: generic path),
    # located once for every later layer
    row_split: tuple[torch.Tensor, _RowSplit | None] | None = None


@dataclass(frozen=True)
class _RowSplit:
    """Rows asked of attend_rows in a step that mixes exact and compressed sequences: the
    exact ones go to the inner cache's attend_rows (only those rows attend), the compressed
    ones to their sparse groups."""

    exact_q: torch.Tensor  # positions in q of rows of exact sequences
    exact_rows: torch.Tensor  # the same rows in the exact sub-batch (one tensor for every layer)
    compressed_q: torch.Tensor  # positions in q of rows of compressed sequences
    compressed_rows: torch.Tensor  # the same rows in the batch


def _sub_layout(layout: CacheLayout, layers: list[int]) -> CacheLayout:
    return CacheLayout.one_per_layer([layout.specs[c] for c in layers])


@register_cache_method("shadowkv", ShadowKVConfig)
class ShadowKVCache(ShadowKVMemory, CacheMethod):
    def __init__(self, layout: CacheLayout, config: ShadowKVConfig, budget_bytes: int,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(layout, compute_dtype, device)
        self.config = config
        heads, dim = layout.num_kv_heads, layout.head_dim
        self.rank_bounds = config.rank_bounds(heads * dim)
        self.budget_bytes = budget_bytes
        self.global_layers = [c for c, s in enumerate(layout.specs) if s.sliding_window is None]
        self.sliding_layers = [c for c, s in enumerate(layout.specs) if s.sliding_window is not None]
        self._inner_index = {c: i for i, c in enumerate(self.global_layers)}
        self._inner_index.update({c: i for i, c in enumerate(self.sliding_layers)})
        self.element = torch.tensor([], dtype=compute_dtype).element_size()
        self.coefficient_dtype = config.coefficient_storage(compute_dtype)
        self.coefficient_element = torch.tensor([], dtype=self.coefficient_dtype).element_size()
        self.exact_layout = _sub_layout(layout, self.global_layers) if self.global_layers else None
        self.sliding_layout = _sub_layout(layout, self.sliding_layers) if self.sliding_layers else None
        num_global = len(self.global_layers)
        chunk = config.chunk
        self.fast_chunk_bytes, self.slow_chunk_bytes = chunk_page_bytes(num_global, heads, dim, chunk,
                                                                        self.element)
        self.slow_budget = config.slow_bytes(budget_bytes)
        if num_global and self.slow_budget < self.slow_chunk_bytes:
            raise ConfigError("slow_budget", self.slow_budget,
                              f"must hold at least one chunk of values ({self.slow_chunk_bytes} bytes)")
        if num_global:  # one split of the budget between the stores (split.py)
            self.split = BudgetSplit.of(budget_bytes, self._sequence_parts, config.split_context,
                                        config.min_context, self.fast_chunk_bytes)
        else:  # sliding layers only: nothing is ever compressed
            self.split = BudgetSplit(exact=0, sliding=budget_bytes, chunk_pages=0, fixed=0)
        exact_config = FullCacheConfig(block_size=config.block_size)
        self.exact = FullCache(self.exact_layout, exact_config, self.split.exact, compute_dtype, device) \
            if self.exact_layout is not None else None
        self.sliding = FullCache(self.sliding_layout, exact_config, self.split.sliding, compute_dtype, device) \
            if self.sliding_layout is not None else None
        self.stats = ShadowKVStats(device_type=self.device.type)
        self.store: ChunkStore | None = None
        self.sparse: SparseAttention | None = None
        if num_global:
            # One page id indexes both tiers: as many pages as the smaller tier holds.
            pages = min(self.split.chunk_pages, self.slow_budget // self.slow_chunk_bytes)
            self.store = ChunkStore(num_global, heads, dim, chunk, pages, compute_dtype, self.device,
                                    config.slow_store, config.slow_dir)
            self.sparse = SparseAttention(self.store, chunk, self.stats, config.reuse, self.device,
                                          config.kernel)
        self._seqs: dict[int, SequenceEntry] = {}
        self._fixed_bytes = 0
        self._reserved_pages = 0
        self._step: _Step | None = None
        self._step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ropes: dict[int, PositionedRope] = {}  # per global layer, for folding at end_step
        # rank=attention: the compressing prompts' last queries (records nothing otherwise)
        self._queries = QuerySampler(enabled=config.rank == "attention")

    # -- statistics -------------------------------------------------------------------
    def statistics(self) -> dict[str, float]:
        usage = self.memory_usage()
        compressed = sum(1 for s in self._seqs.values() if s.compressed is not None)
        return {**self.stats.as_dict(), "fast_bytes": usage["fast"], "slow_bytes": usage["slow"],
                "compressed_sequences": compressed, "exact_sequences": len(self._seqs) - compressed}

    def reset_statistics(self) -> None:
        """Zero the counters and timers (bytes are state and stay); benchmarks call it
        before a timed phase."""
        self.stats.reset()

    # -- sequences --------------------------------------------------------------------
    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._release_reservation(seq)
        for inner in (self.exact, self.sliding):
            if inner is not None:
                inner.free(seq_id)
        if seq.compressed is not None:
            self.store.pool.free(seq.compressed.pages)  # type: ignore[union-attr]
            self._fixed_bytes -= seq.compressed.fixed_bytes

    def num_cached_tokens(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return seq.num_tokens if seq is not None else 0

    def is_compressed(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.compressed is not None

    # -- step -------------------------------------------------------------------------
    def begin_step(self, batch: ForwardBatch) -> None:
        super().begin_step(batch)
        exact: list[SequenceSpan] = []
        compressing: list[SequenceSpan] = []
        decoding: list[SequenceSpan] = []
        multi: list[SequenceSpan] = []
        known = batch.logit_row_list  # host ints: no device read (a decode step reads nothing)
        logit_rows = set(known if known is not None else batch.logit_rows.tolist()) if self.exact is not None \
            else set()
        for span in batch.spans:
            seq = self._seqs.get(span.seq_id)
            if seq is None or seq.reservation is None or seq.reservation.target != span.total_len:
                raise ConfigError("seq_id", span.seq_id, "call allocate() for the step before running it")
            if seq.compressed is None:
                exact.append(span)
                if seq.reservation.compress and span.query_end - 1 in logit_rows:
                    compressing.append(span)
            elif span.query_len == 1:
                decoding.append(span)
            else:
                multi.append(span)
        exact_batch, exact_rows = self._exact_batch(batch, exact)
        groups: list[SparseGroup] = []
        if decoding:
            groups.append(self._group(decoding))
        groups.extend(self._group([span]) for span in multi)
        self._step = _Step(exact_batch, exact_rows, tuple(compressing), tuple(decoding + multi), tuple(groups),
                           bool(decoding or multi))
        if self.exact is not None and exact_batch is not None:
            self.exact.begin_step(exact_batch)
        if self.sliding is not None:
            self.sliding.begin_step(batch)
        self._step_kv = {}
        self._queries.clear()

    def _group(self, spans: list[SequenceSpan]) -> SparseGroup:
        states = [self._seqs[s.seq_id].compressed for s in spans]
        rows = [row for s in spans for row in range(s.query_start, s.query_end)]
        kernel = self.sparse is not None and self.sparse.uses_kernel(self.compute_dtype)
        return SparseGroup.build(states, rows, spans[0].query_len, spans[0].query_len == 1,  # type: ignore[arg-type]
                                 self.config.chunk, self.device, kernel)

    def _exact_batch(self, batch: ForwardBatch, spans: list[SequenceSpan]
                     ) -> tuple[ForwardBatch | None, torch.Tensor | None]:
        """The batch restricted to exact sequences, rows renumbered; (batch, None) if all are."""
        if len(spans) == len(batch.spans):
            return batch, None
        if not spans:
            return None, None
        rows: list[int] = []
        renumbered: list[SequenceSpan] = []
        for span in spans:
            renumbered.append(SequenceSpan(span.seq_id, len(rows), span.query_len, span.cached_len))
            rows.extend(range(span.query_start, span.query_end))
        index = upload(torch.tensor(rows, dtype=torch.long), batch.token_ids.device)
        sub = ForwardBatch(token_ids=batch.token_ids[index], positions=batch.positions[index],
                           spans=tuple(renumbered), logit_rows=index.new_empty(0), logit_row_list=())
        return sub, index

    def _exact_rope(self, rope: PositionedRope) -> PositionedRope:
        step = self._step
        assert step is not None
        if step.exact_rows is None:
            return rope
        key = id(rope)
        if key not in step.ropes:
            rows = step.exact_rows
            step.ropes[key] = PositionedRope(cos=rope.cos[rows], sin=rope.sin[rows], rotary=rope.rotary)
        return step.ropes[key]

    def write(self, cache_layer: int, batch: ForwardBatch, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        step = self._step
        assert step is not None, "begin_step first"
        index = self._inner_index[cache_layer]
        if cache_layer in self.sliding_layers:
            assert self.sliding is not None
            self.sliding.write(index, batch, k_pre, v, rope)
            return
        assert self.exact is not None
        self._ropes[index] = rope
        if step.exact_batch is not None:
            rows = step.exact_rows
            self.exact.write(index, step.exact_batch, k_pre if rows is None else k_pre[rows],
                             v if rows is None else v[rows], self._exact_rope(rope))
        if step.any_compressed:
            k_post = rope.apply(k_pre)
            self._step_kv[cache_layer] = (k_post, v)
            chunk = self.config.chunk
            for group in step.groups:
                if group.own_in_buffer and not group.kernel:  # decode tokens: the next window row
                    for b, state in enumerate(group.states):
                        layer = state.layers[index]
                        assert layer is not None
                        row, token = state.window_start(chunk) + state.window, group.row_list[b]
                        layer.keys[:, row] = k_post[token]
                        layer.values[:, row] = v[token]

    def attend(self, cache_layer: int, batch: ForwardBatch, q: torch.Tensor,
               rope: PositionedRope) -> torch.Tensor:
        step = self._step
        assert step is not None, "begin_step first"
        index = self._inner_index[cache_layer]
        if cache_layer in self.sliding_layers:
            assert self.sliding is not None
            return self.sliding.attend(index, batch, q, rope)
        assert self.exact is not None
        self._queries.record(cache_layer, batch, step.compressing, q)
        if step.exact_batch is batch:
            return self.exact.attend(index, batch, q, rope)
        out = torch.empty_like(q)
        if step.exact_batch is not None:
            rows = step.exact_rows
            out[rows] = self.exact.attend(index, step.exact_batch, q[rows], self._exact_rope(rope))
        self._attend_compressed(cache_layer, q, rope, out)
        return out

    def _attend_compressed(self, cache_layer: int, q: torch.Tensor, rope: PositionedRope, out: torch.Tensor) -> None:
        """Attention of the step's compressed sequences (their sparse groups): q and out
        cover every row of the batch; only the groups' rows of out are written."""
        step = self._step
        assert step is not None
        if not step.groups:
            return
        assert self.sparse is not None
        k_post, v = self._step_kv[cache_layer]
        scale = self.layout.specs[cache_layer].scale
        # The fused kernel is one parallel loop over (sequence, KV head) pairs per layer:
        # it uses torch's threads. `threads` is for the PyTorch path's many small ops.
        kernel_only = all(group.kernel for group in step.groups)
        with cpu_threads(0 if kernel_only else self.config.threads, self.device):
            self._attend_groups(self._inner_index[cache_layer], step.groups, q, k_post, v, rope, scale, out)

    def _attend_groups(self, index: int, groups: tuple[SparseGroup, ...], q: torch.Tensor, k_post: torch.Tensor,
                       v: torch.Tensor, rope: PositionedRope, scale: float, out: torch.Tensor) -> None:
        assert self.sparse is not None
        for group in groups:
            shape = (group.size, group.queries)
            result = self.sparse.attend(index, group, q[group.rows].view(*shape, *q.shape[1:]),
                                        k_post[group.rows].view(*shape, *k_post.shape[1:]),
                                        v[group.rows].view(*shape, *v.shape[1:]), rope, scale)
            out[group.rows] = result.view(-1, *q.shape[1:])

    def attend_rows(self, cache_layer: int, batch: ForwardBatch, q: torch.Tensor, rope: PositionedRope,
                    rows: torch.Tensor) -> torch.Tensor:
        step = self._step
        assert step is not None, "begin_step first"
        index = self._inner_index[cache_layer]
        if cache_layer in self.sliding_layers:
            assert self.sliding is not None
            return self.sliding.attend_rows(index, batch, q, rope, rows)
        self._queries.record(cache_layer, batch, step.compressing, q, rows)
        if step.exact_batch is batch:
            assert self.exact is not None
            return self.exact.attend_rows(index, batch, q, rope, rows)
        if step.row_split is None or step.row_split[0] is not rows:
            step.row_split = (rows, self._split_rows(batch, rows))
        split = step.row_split[1]
        if split is None or step.exact_batch is None:
            return super().attend_rows(cache_layer, batch, q, rope, rows)
        # A mixed step (prompts of exact sequences beside compressed ones decoding): the
        # generic path would attend every prompt row of the exact sequences, which SwiftKV's
        # later layers exist to skip.
        assert self.exact is not None
        out = q.new_empty(q.shape)
        if split.exact_q.numel():
            out[split.exact_q] = self.exact.attend_rows(index, step.exact_batch, q[split.exact_q],
                                                        self._exact_rope(rope), split.exact_rows)
        if split.compressed_q.numel():
            full = q.new_zeros((batch.num_tokens, *q.shape[1:]))
            full[split.compressed_rows] = q[split.compressed_q]
            attended = torch.empty_like(full)
            self._attend_compressed(cache_layer, full, rope, attended)
            out[split.compressed_q] = attended[split.compressed_rows]
        return out

    def _split_rows(self, batch: ForwardBatch, rows: torch.Tensor) -> _RowSplit | None:
        """Where attend_rows' rows go in a mixed step (None unless they are trailing rows of
        each span, as SwiftKV's logit rows are)."""
        counts = batch.trailing_counts(rows)
        step = self._step
        if counts is None or step is None or step.exact_batch is None:
            return None
        exact_spans = {span.seq_id: span for span in step.exact_batch.spans}
        exact_q: list[int] = []
        exact_rows: list[int] = []
        compressed_q: list[int] = []
        compressed_rows: list[int] = []
        position = 0
        for span, count in zip(batch.spans, counts):
            inner = exact_spans.get(span.seq_id)
            for offset in range(count):
                row = span.query_end - count + offset
                if inner is not None:
                    exact_q.append(position)
                    exact_rows.append(inner.query_end - count + offset)
                else:
                    compressed_q.append(position)
                    compressed_rows.append(row)
                position += 1
        as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731 (host: see upload)
        return upload(_RowSplit(as_long(exact_q), as_long(exact_rows), as_long(compressed_q),
                                as_long(compressed_rows)), self.device)

    def end_step(self, batch: ForwardBatch) -> None:
        step = self._step
        assert step is not None, "begin_step first"
        if self.exact is not None and step.exact_batch is not None:
            self.exact.end_step(step.exact_batch)
        if self.sliding is not None:
            self.sliding.end_step(batch)
        if step.compressing:
            with cpu_threads(self.config.threads, self.device):
                for span in step.compressing:
                    self._compress(span)
        # Appending a decode token is a few tiny copies; only folds are worth switching the
        # thread count for.
        folding = any(self._seqs[s.seq_id].reservation.pages for s in step.compressed_spans)  # type: ignore[union-attr]
        with cpu_threads(self.config.threads if folding else 0, self.device):
            for span in step.compressed_spans:
                self._append(span, in_buffer=span.query_len == 1)
        for span in batch.spans:
            seq = self._seqs[span.seq_id]
            seq.num_tokens = span.total_len
            self._release_reservation(seq)
        self._step = None
        self._step_kv = {}

    # -- compression and folding ------------------------------------------------------
    def _compress(self, span: SequenceSpan) -> None:
        """Compress every global layer of a sequence from its exact pages (committed, this
        step's tokens included), then free the pages."""
        assert self.exact is not None and self.store is not None
        seq = self._seqs[span.seq_id]
        reservation = seq.reservation
        assert reservation is not None and reservation.compress and seq.compressed is None
        config, chunk = self.config, self.config.chunk
        n = span.total_len
        prefix = self._compressed_chunks(n) * chunk
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
                layer_rank = config.rank_rule(self._queries.sample(cache_layer, span.seq_id),
                                              self.layout.specs[cache_layer].scale)
                layer, data = compress_layer(keys, values, self._ropes[index], prefix, layer_rank, chunk,
                                             config.outliers, config.window_capacity, chunks_per_step,
                                             self.coefficient_dtype)
                self.store.write(index, state.page_table, data.landmarks, data.values)
                state.layers[index] = layer
                state.ranks.append(layer.basis.shape[0])
        state.fixed_bytes = self._fixed_state_bytes(n, len(pages), state.ranks)
        assert state.fixed_bytes <= fixed, "compression reserved the largest rank"
        self._fixed_bytes -= fixed - state.fixed_bytes
        self.stats.record_ranks(state.ranks)
        seq.compressed = state
        self.exact.free(span.seq_id)
        self.stats.compressions += 1

    def _append(self, span: SequenceSpan, in_buffer: bool) -> None:
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
        folds = self._fold_count(grown)
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
                k_post, v = self._step_kv[cache_layer]
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
                                   layer.basis, self._ropes[index], chunk)
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
