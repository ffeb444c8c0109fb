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

What a sequence costs is declared in memory.py (`ShadowKVMemorySpec`); reservations and
usage are the `ShadowKVAllocator` mixin in allocator.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.base import CacheMethod
from kvforge.cache.full.method import FullCache, FullCacheConfig
from kvforge.cache.layout import CacheLayout
from kvforge.cache.registry import register_cache_method
from kvforge.cache.shadowkv.allocator import SequenceEntry, ShadowKVAllocator
from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.memory import ShadowKVMemorySpec, ShadowKVSizes, chunk_page_bytes
from kvforge.cache.shadowkv.query_samples import QuerySampler
from kvforge.cache.shadowkv.sparse import SparseAttention, SparseGroup
from kvforge.cache.shadowkv.split import PARTS, BudgetSplit
from kvforge.cache.shadowkv.static_decode import ShadowKVStaticDecode, scratch_state
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.step import ShadowKVStepMetadata, exact_rope, exact_sub_batch, split_rows
from kvforge.cache.shadowkv.store import ChunkStore
from kvforge.cache.shadowkv.threads import cpu_threads
from kvforge.cache.shadowkv.transitions import ShadowKVTransitions
from kvforge.errors import ConfigError
from kvforge.rope import PositionedRope


def _sub_layout(layout: CacheLayout, layers: list[int]) -> CacheLayout:  # (bounded as layout is)
    return replace(layout, layer_to_cache=tuple(range(len(layers))), specs=tuple(layout.specs[c] for c in layers))


@register_cache_method("shadowkv", ShadowKVConfig)
class ShadowKVCache(ShadowKVTransitions, ShadowKVAllocator, CacheMethod[ShadowKVStepMetadata]):
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
        element = torch.tensor([], dtype=compute_dtype).element_size()
        self.coefficient_dtype = config.coefficient_storage(compute_dtype)
        exact_layout = _sub_layout(layout, self.global_layers) if self.global_layers else None
        sliding_layout = _sub_layout(layout, self.sliding_layers) if self.sliding_layers else None
        num_global = len(self.global_layers)
        chunk = config.chunk
        self.fast_chunk_bytes, self.slow_chunk_bytes = chunk_page_bytes(num_global, heads, dim, chunk, element)
        sizes = ShadowKVSizes(layout, config, self.rank_bounds, element,
                              torch.tensor([], dtype=self.coefficient_dtype).element_size(),
                              tuple(self.global_layers), tuple(self.sliding_layers), exact_layout, sliding_layout,
                              self.fast_chunk_bytes, self.slow_chunk_bytes)
        self.slow_budget = config.slow_bytes(budget_bytes)
        if num_global and self.slow_budget < self.slow_chunk_bytes:
            raise ConfigError("slow_budget", self.slow_budget,
                              f"must hold at least one chunk of values ({self.slow_chunk_bytes} bytes)")
        if num_global:  # one split of the budget between the stores (split.py)
            self.split = BudgetSplit.of(budget_bytes, sizes.sequence_parts, config.split_context, config.min_context,
                                        self.fast_chunk_bytes, config.exact_share, layout.max_sequence_tokens)
        else:  # sliding layers only: nothing is ever compressed
            self.split = BudgetSplit(exact=0, sliding=budget_bytes, chunk_pages=0, fixed=0)
        exact_config = FullCacheConfig(block_size=config.block_size)
        self.exact = FullCache(exact_layout, exact_config, self.split.exact, compute_dtype, device) \
            if exact_layout is not None else None
        self.sliding = FullCache(sliding_layout, exact_config, self.split.sliding, compute_dtype, device) \
            if sliding_layout is not None else None
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
        inner = {"exact": self.exact, "sliding": self.sliding}
        store_capacity = {name: inner[name].memory.capacity["fast"] if inner[name] is not None else 0
                          for name in ("exact", "sliding")}
        store_capacity["chunks"] = self.store.num_pages * self.fast_chunk_bytes if self.store is not None else 0
        store_capacity["fixed"] = self.split.fixed
        assert set(store_capacity) == set(PARTS)
        slow = self.store.num_pages * self.slow_chunk_bytes if self.store is not None else 0
        self.memory = ShadowKVMemorySpec(layout.num_cache_layers, sizes, store_capacity, budget_bytes, slow)
        self._seqs: dict[int, SequenceEntry] = {}
        self._fixed_bytes = 0
        self._reserved_pages = 0

    def start_up_line(self) -> str | None:
        store = self.store
        if store is None or store.pinned_seconds is None:
            return None
        size = store.values.numel() * store.values.element_size()
        return (f"ShadowKV's slow tier: {size / 2**30:.1f} GiB of RAM page-locked in {store.pinned_seconds:.1f} s "
                f"(slow_store=pinned: the decode kernels read values from it in place)")

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
    def begin_step(self, batch: ForwardBatch) -> ShadowKVStepMetadata:
        return self._begin_step(batch, self.device)

    def _begin_step(self, batch: ForwardBatch, group_device: torch.device) -> ShadowKVStepMetadata:
        """begin_step with the sparse groups' and inner plans' tensors on `group_device` (the
        fixed step plans on the host: its own buffers are what the device reads)."""
        self.check_batch(batch)
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
        exact_batch, exact_rows = exact_sub_batch(batch, exact)
        groups: list[SparseGroup] = []
        if decoding:
            groups.append(self._group(decoding, group_device))
        groups.extend(self._group([span], group_device) for span in multi)
        return ShadowKVStepMetadata(
            batch,
            exact=self.exact.begin_step_on(exact_batch, group_device)
            if self.exact is not None and exact_batch is not None else None,
            sliding=self.sliding.begin_step_on(batch, group_device) if self.sliding is not None else None,
            exact_rows=exact_rows, compressing=tuple(compressing), compressed_spans=tuple(decoding + multi),
            groups=tuple(groups), any_compressed=bool(decoding or multi),
            queries=QuerySampler(enabled=self.config.rank == "attention"))

    def _group(self, spans: list[SequenceSpan], device: torch.device) -> SparseGroup:
        states = [self._seqs[s.seq_id].compressed for s in spans]
        rows = [row for s in spans for row in range(s.query_start, s.query_end)]
        kernel = self.sparse is not None and self.sparse.uses_kernel(self.compute_dtype)
        return SparseGroup.build(states, rows, spans[0].query_len, spans[0].query_len == 1,  # type: ignore[arg-type]
                                 self.config.chunk, device, kernel)

    def static_decode(self, rows: int, max_tokens: int) -> ShadowKVStaticDecode | None:
        """Fixed-shape decode steps of exact and compressed sequences (static_decode.py) when
        the step reads nothing on the host: the Triton path with the slow tier read in place.
        Otherwise None: eager. A bucket shorter than min_context only ever holds exact
        sequences: its step has no sparse part (slots 0)."""
        if self.why_no_static_decode():
            return None
        chunk, heads = self.config.chunk, self.layout.num_kv_heads
        scratch = scratch_state(heads, self.layout.head_dim, chunk, self.compute_dtype, self.coefficient_dtype,
                                self.device)
        host = torch.device("cpu")
        assert self.exact is not None
        self._set_aside_scratch_pages()
        pages = lambda inner: (inner.pages, -(-max_tokens // inner.block_size))  # noqa: E731
        slots = max(1, self.config.budget_tokens(max_tokens, heads) // chunk) \
            if max_tokens >= self.config.min_context else 0
        return ShadowKVStaticDecode(lambda batch: self._begin_step(batch, host), len(self.global_layers), scratch,
                                    chunk, self.device, rows, -(-max_tokens // chunk),
                                    slots, pages(self.exact),
                                    pages(self.sliding) if self.sliding is not None else None)

    def _set_aside_scratch_pages(self) -> None:
        """The inner caches' scratch pages (what the fixed step's padding rows write), left
        out of the stores' capacities that admission checks."""
        inner = {"exact": self.exact, "sliding": self.sliding}
        for cache in inner.values():
            if cache is not None:
                cache.set_aside_scratch_pages()
        capacity = {name: cache.memory.capacity["fast"] for name, cache in inner.items() if cache is not None}
        self.memory = replace(self.memory, store_capacity={**self.memory.store_capacity, **capacity})

    def why_no_static_decode(self) -> str:
        """Empty when decode steps of compressed sequences can run in fixed shapes."""
        if self.sparse is None:
            return "ShadowKV compresses no layer of this model (sliding-window layers only)"
        if not self.sparse.triton:
            return "ShadowKV's fixed decode step runs its Triton kernels (CUDA, `triton` installed, kernel=1)"
        if not self.sparse.values_in_place:
            return ("ShadowKV's fixed decode step reads the slow tier in place: run it with "
                    "--cache-opt slow_store=pinned")
        return ""

    def write(self, cache_layer: int, meta: ShadowKVStepMetadata, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        index = self._inner_index[cache_layer]
        if cache_layer in self.sliding_layers:
            assert self.sliding is not None and meta.sliding is not None
            self.sliding.write(index, meta.sliding, k_pre, v, rope)
            return
        assert self.exact is not None
        meta.layer_ropes[index] = rope
        if meta.exact is not None:
            rows = meta.exact_rows
            self.exact.write(index, meta.exact, k_pre if rows is None else k_pre[rows],
                             v if rows is None else v[rows], exact_rope(meta, rope))
        if meta.any_compressed:
            if meta.exact is not None and meta.exact_rows is None:  # (a fixed step) the exact write roped every row
                k_post = meta.exact.step_kv[index][0]
            else:
                k_post = rope.apply(k_pre)
            meta.step_kv[cache_layer] = (k_post, v)
            chunk = self.config.chunk
            assert self.sparse is not None
            for group in meta.groups:
                if group.own_in_buffer and not self.sparse.writes_own_tokens(group):  # the next window row
                    for b, state in enumerate(group.states):
                        layer = state.layers[index]
                        assert layer is not None
                        row, token = state.window_start(chunk) + state.window, group.row_list[b]
                        layer.keys[:, row] = k_post[token]
                        layer.values[:, row] = v[token]

    def attend(self, cache_layer: int, meta: ShadowKVStepMetadata, q: torch.Tensor,
               rope: PositionedRope) -> torch.Tensor:
        index = self._inner_index[cache_layer]
        if cache_layer in self.sliding_layers:
            assert self.sliding is not None and meta.sliding is not None
            return self.sliding.attend(index, meta.sliding, q, rope)
        assert self.exact is not None
        meta.queries.record(cache_layer, meta.batch, meta.compressing, q)
        if meta.mixed_rows is not None:
            assert meta.exact is not None
            return self._keep_own(meta, self.exact.attend(index, meta.exact, q, rope),
                                  self._attend_compressed(cache_layer, meta, q, rope, None))
        if meta.exact_batch is meta.batch:
            return self.exact.attend(index, meta.exact, q, rope)  # type: ignore[arg-type]
        if meta.exact is None and len(meta.groups) == 1:
            # every sequence compressed, in one group (decoding, a fixed step's form "compressed",
            # or one multi-token span alone): its rows are every row in order, no gather or scatter
            return self._attend_compressed(cache_layer, meta, q, rope, None)
        out = torch.empty_like(q)
        if meta.exact is not None:
            rows = meta.exact_rows
            out[rows] = self.exact.attend(index, meta.exact, q[rows], exact_rope(meta, rope))
        return self._attend_compressed(cache_layer, meta, q, rope, out)

    @staticmethod
    def _keep_own(meta: ShadowKVStepMetadata, exact: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
        """A fixed step's rows each from its own attention (the other saw padding)."""
        if meta.keep_exact is None:
            meta.keep_exact = meta.mixed_rows.view(-1, *([1] * (exact.dim() - 1))) != 0  # type: ignore[union-attr]
        return torch.where(meta.keep_exact, exact, compressed)

    def _attend_compressed(self, cache_layer: int, meta: ShadowKVStepMetadata, q: torch.Tensor,
                           rope: PositionedRope, out: torch.Tensor | None) -> torch.Tensor:
        """Attention of the step's compressed sequences (their sparse groups): q and out
        cover every row of the batch; only the groups' rows of out are written, and out is
        returned. out None: one group of every row in order, whose result is returned."""
        if not meta.groups:
            assert out is not None
            return out
        assert self.sparse is not None
        k_post, v = meta.step_kv[cache_layer]
        scale = self.layout.specs[cache_layer].scale
        # The fused kernel is one parallel loop over (sequence, KV head) pairs per layer:
        # it uses torch's threads. `threads` is for the PyTorch path's many small ops.
        kernel_only = all(group.kernel for group in meta.groups)
        with cpu_threads(0 if kernel_only else self.config.threads, self.device):
            return self._attend_groups(self._inner_index[cache_layer], meta.groups, q, k_post, v, rope, scale, out)

    def _attend_groups(self, index: int, groups: tuple[SparseGroup, ...], q: torch.Tensor, k_post: torch.Tensor,
                       v: torch.Tensor, rope: PositionedRope, scale: float, out: torch.Tensor | None) -> torch.Tensor:
        assert self.sparse is not None
        for group in groups:
            shape = (group.size, group.queries)
            if out is None:  # the group is every row of the batch, in order
                return self.sparse.attend(index, group, q.view(*shape, *q.shape[1:]),
                                          k_post.view(*shape, *k_post.shape[1:]), v.view(*shape, *v.shape[1:]),
                                          rope, scale).view(q.shape)
            result = self.sparse.attend(index, group, q[group.rows].view(*shape, *q.shape[1:]),
                                        k_post[group.rows].view(*shape, *k_post.shape[1:]),
                                        v[group.rows].view(*shape, *v.shape[1:]), rope, scale)
            out[group.rows] = result.view(-1, *q.shape[1:])
        assert out is not None
        return out

    def attend_rows(self, cache_layer: int, meta: ShadowKVStepMetadata, q: torch.Tensor, rope: PositionedRope,
                    rows: torch.Tensor) -> torch.Tensor:
        index = self._inner_index[cache_layer]
        if cache_layer in self.sliding_layers:
            assert self.sliding is not None and meta.sliding is not None
            return self.sliding.attend_rows(index, meta.sliding, q, rope, rows)
        meta.queries.record(cache_layer, meta.batch, meta.compressing, q, rows)
        if meta.fixed and meta.groups:
            if rows is not meta.batch.logit_rows:  # (its sparse group is every row, in order)
                raise ValueError("a fixed ShadowKV decode step attends its logit rows: every row, in order")
            compressed = self._attend_compressed(cache_layer, meta, q, rope, None)
            if meta.mixed_rows is None:  # form "compressed": every row compressed or padding
                return compressed
            assert meta.exact is not None
            return self._keep_own(meta, self.exact.attend_rows(index, meta.exact, q, rope, rows), compressed)
        if meta.exact_batch is meta.batch:
            assert self.exact is not None and meta.exact is not None
            return self.exact.attend_rows(index, meta.exact, q, rope, rows)
        if meta.row_split is None or meta.row_split[0] is not rows:
            meta.row_split = (rows, split_rows(meta, rows, self.device))
        split = meta.row_split[1]
        if split is None or meta.exact is None:
            return super().attend_rows(cache_layer, meta, q, rope, rows)
        # A mixed step (prompts of exact sequences beside compressed ones decoding): the
        # generic path would attend every prompt row of the exact sequences, which SwiftKV's
        # later layers exist to skip.
        assert self.exact is not None
        out = q.new_empty(q.shape)
        if split.exact_q.numel():
            out[split.exact_q] = self.exact.attend_rows(index, meta.exact, q[split.exact_q],
                                                        exact_rope(meta, rope), split.exact_rows)
        if split.compressed_q.numel():
            full = q.new_zeros((meta.batch.num_tokens, *q.shape[1:]))
            full[split.compressed_rows] = q[split.compressed_q]
            attended = torch.empty_like(full)
            self._attend_compressed(cache_layer, meta, full, rope, attended)
            out[split.compressed_q] = attended[split.compressed_rows]
        return out

    def end_step(self, meta: ShadowKVStepMetadata) -> None:
        if self.exact is not None and meta.exact is not None:
            self.exact.end_step(meta.exact)
        if self.sliding is not None and meta.sliding is not None:
            self.sliding.end_step(meta.sliding)
        if meta.compressing:
            with cpu_threads(self.config.threads, self.device):
                for span in meta.compressing:
                    self._compress(span, meta)
        # Appending a decode token is a few tiny copies; only folds are worth switching the
        # thread count for.
        folding = any(self._seqs[s.seq_id].reservation.pages for s in meta.compressed_spans)  # type: ignore[union-attr]
        with cpu_threads(self.config.threads if folding else 0, self.device):
            for span in meta.compressed_spans:
                self._append(span, meta, in_buffer=span.query_len == 1)
        for span in meta.batch.spans:
            seq = self._seqs[span.seq_id]
            seq.num_tokens = span.total_len
            self._release_reservation(seq)
