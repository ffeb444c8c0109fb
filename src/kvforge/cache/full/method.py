"""The `full` cache method: post-RoPE K and V in fp32/bf16/fp16, or float8 with a scale per
token and KV head (fp8.py), on a paged block pool.

Storage per side (K, V): [group_size, kv_heads, num_pages, block_size, head_dim], one
page id valid for every layer of a group (see page_table.py). Head-major so that gathering
a batch's pages gives [kv_heads, sequences, tokens, head_dim], ready for batched matmuls. The number of pages is fixed by
the byte budget at construction; `torch.empty` reserves address space, and memory is
touched only as pages are used.

Attention of a step = the step's own exact K/V (causal) + what is stored for earlier
tokens. Prefill chunks gather their visible past once per layer (compute is already
chunk x context); decode tokens are batched and read pages in place (the C++ kernel on the
CPU, the paged Triton kernel on CUDA: decode_kernels.py) or tile by tile. float8 pages are
dequantised by every path: `fp8.dequantize` in PyTorch, per row in registers in the C++
decode kernel (parity-tested against the PyTorch path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.attention import chunk_attention, decode_attention, gathered_decode_attention, select_pages
from kvforge.cache.base import CacheMethod
from kvforge.cache.block_pool import BlockPool
from kvforge.cache.full.config import STORAGE_DTYPES, FullCacheConfig
from kvforge.cache.full.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kvforge.cache.full.decode_kernels import resolve_decode_kernel, triton_module, triton_store_module
from kvforge.cache.full.fp8 import SCALE_BYTES, SCALE_DTYPE, dequantize, is_fp8, quantize_per_token
from kvforge.cache.full.fused_target import FullFusedTarget
from kvforge.cache.full.memory import PagedMemorySpec
from kvforge.cache.full.plan import (
    DecodePlan,
    FullStepMetadata,
    GroupPlan,
    RowQueries,
    locate_rows,
    plan_step,
)
from kvforge.cache.full.static_decode import FullStaticDecode
from kvforge.cache.layout import CacheLayout
from kvforge.cache.page_table import LayerGroups, PageTable
from kvforge.cache.registry import register_cache_method
from kvforge.cache.static_decode import SCRATCH_SEQ
from kvforge.errors import CacheCapacityError, ConfigError
from kvforge.rope import PositionedRope


@register_cache_method("full", FullCacheConfig)
class FullCache(CacheMethod[FullStepMetadata]):
    def __init__(self, layout: CacheLayout, config: FullCacheConfig, budget_bytes: int,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(layout, compute_dtype, device)
        self.config = config
        self.storage_dtype = STORAGE_DTYPES[config.storage_dtype] if config.storage_dtype else compute_dtype
        self.groups = LayerGroups.from_layout(layout)
        self.block_size = config.block_size
        element = torch.tensor([], dtype=self.storage_dtype).element_size()
        self.fp8 = is_fp8(self.storage_dtype)
        # K and V rows of one token and layer (plus their scales when float8)
        row_bytes = layout.head_dim * element + (SCALE_BYTES if self.fp8 else 0)
        token_layer_bytes = 2 * layout.num_kv_heads * row_bytes
        self.page_bytes = self.groups.group_size * self.block_size * token_layer_bytes
        num_pages = budget_bytes // self.page_bytes
        minimum = self.groups.num_groups * self.page_bytes
        if num_pages < self.groups.num_groups:
            raise ConfigError(
                "kv_budget", budget_bytes,
                f"must hold at least one block per layer group: {self.groups.num_groups} group(s) x "
                f"{self.page_bytes} bytes = {minimum} bytes (block_size={self.block_size})")
        self.budget_bytes = budget_bytes
        self.memory = PagedMemorySpec(layout.num_cache_layers, self.groups, self.block_size, token_layer_bytes,
                                      self.page_bytes, num_pages)
        shape = (self.groups.group_size, layout.num_kv_heads, num_pages, self.block_size, layout.head_dim)
        # The stores first: a budget the device cannot hold fails here at once, before the
        # page pool's free list (one Python int per page) is built for it.
        self.k_store = torch.empty(shape, dtype=self.storage_dtype, device=self.device)
        self.v_store = torch.empty(shape, dtype=self.storage_dtype, device=self.device)
        self.pages = PageTable(BlockPool(num_pages), self.block_size, self.groups)
        self.scratch_pages = 0  # set aside for fixed decode steps (set_aside_scratch_pages)
        # float8: the scale of each stored row [group_size, kv_heads, num_pages, block]
        self.k_scales = torch.empty(shape[:-1], dtype=SCALE_DTYPE, device=self.device) if self.fp8 else None
        self.v_scales = torch.empty(shape[:-1], dtype=SCALE_DTYPE, device=self.device) if self.fp8 else None
        # "triton", "gather", "torch", or "auto" (decided per step: decode_kernels.py)
        self.decode_kernel = resolve_decode_kernel(config.decode_kernel, self.device, self.fp8)

    # -- allocator --------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.pages.allocate(seq_id, num_tokens)

    def free(self, seq_id: int) -> None:
        self.pages.free(seq_id)

    def num_cached_tokens(self, seq_id: int) -> int:
        return self.pages.num_tokens(seq_id)

    def memory_usage(self) -> dict[str, int]:
        """(The scratch pages are left out, as they are of `memory.capacity`.)"""
        return {"fast": (self.pages.pool.num_used - self.scratch_pages) * self.page_bytes, "slow": 0}

    def statistics(self) -> dict[str, float]:
        pool = self.pages.pool
        return {"pages_used": pool.num_used - self.scratch_pages, "pages_total": pool.num_blocks - self.scratch_pages,
                "pages_cached": pool.num_cached,
                "pages_evicted": pool.evictions, "sequences": len(self.pages.sequences())}

    # -- prefix caching: pages are final once full (exact K/V of fixed tokens and positions)
    @property
    def prefix_block_size(self) -> int:  # type: ignore[override]
        return self.block_size

    def match_prefix(self, seq_id: int, page_keys: Sequence[bytes], max_tokens: int) -> int:
        found = self.pages.find_prefix(page_keys, max_tokens // self.block_size)
        if found is None:
            return 0
        pages, tables = found
        self.pages.attach(seq_id, pages * self.block_size, tables)
        return pages * self.block_size

    def publish_prefix(self, seq_id: int, page_keys: Sequence[bytes]) -> None:
        self.pages.publish(seq_id, page_keys)

    def forget_prefixes(self) -> None:
        self.pages.pool.forget_cached()

    # -- step -------------------------------------------------------------------------
    def begin_step(self, batch: ForwardBatch) -> FullStepMetadata:
        return self.begin_step_on(batch, self.device)

    def begin_step_on(self, batch: ForwardBatch, device: torch.device) -> FullStepMetadata:
        """begin_step with the plan's tensors on `device` (an outer method's fixed step plans
        its inner caches on the host: its own buffers are what the device reads)."""
        self.check_batch(batch)
        return plan_step(self.pages, batch, device)

    def end_step(self, meta: FullStepMetadata) -> None:
        for span in meta.batch.spans:
            self.pages.commit(span.seq_id, span.total_len)

    def write(self, cache_layer: int, meta: FullStepMetadata, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        group, index = self.groups.slot_of[cache_layer]
        plan = meta.groups[group]
        if self._rope_and_store(cache_layer, meta, index, plan, k_pre, v, rope):
            return
        k = rope.apply(k_pre)
        meta.step_kv[cache_layer] = (k, v)
        if plan.write_rows is not None:
            k, v = k[plan.write_rows], v[plan.write_rows]
        for store, scales, values in ((self.k_store, self.k_scales, k), (self.v_store, self.v_scales, v)):
            self._store_rows(store[index], None if scales is None else scales[index], plan.write_slots,
                             values.transpose(0, 1))

    def _rope_and_store(self, cache_layer: int, meta: FullStepMetadata, index: int, plan: GroupPlan,
                        k_pre: torch.Tensor, v: torch.Tensor, rope: PositionedRope) -> bool:
        """With the Triton decode kernel (CUDA): RoPE and both page stores of a step that
        stores every row, in one launch (cache/full/triton_store.py); False when it does not
        apply (the PyTorch path then runs)."""
        if self.decode_kernel != "triton" or plan.write_rows is not None or self.k_scales is not None:
            return False
        store = triton_store_module()
        k_pages, v_pages = self.k_store[index], self.v_store[index]
        if not store.rope_store_applies(k_pre, v, rope.cos, rope.sin, k_pages, v_pages):
            return False
        k = store.rope_and_store(k_pre, v, rope.cos, rope.sin, k_pages, v_pages, plan.write_slots)
        meta.step_kv[cache_layer] = (k, v)
        return True

    def _store_rows(self, pages: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                    rows: torch.Tensor) -> None:
        """rows [kv_heads, T, D] into one layer's pages [kv_heads, num_pages, block, D] at the
        flat slots (page x block + offset) [T]; float8 pages also get each row's scale."""
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        flat = pages.view(heads, -1, dim)
        if scales is None:
            flat.index_copy_(1, slots, rows.to(self.storage_dtype))
            return
        codes, row_scales = quantize_per_token(rows, self.storage_dtype)
        # through bytes: torch's CPU index_copy_ has no float8 kernel
        flat.view(torch.uint8).index_copy_(1, slots, codes.view(torch.uint8))
        scales.view(heads, -1).index_copy_(1, slots, row_scales)

    def set_aside_scratch_pages(self) -> None:
        """Take, once, the pages that padding rows of fixed decode steps write (one per layer
        group, held by SCRATCH_SEQ), and leave them out of `memory`: admission then never
        promises a sequence a page it cannot have."""
        if self.pages.has(SCRATCH_SEQ):
            return
        free = self.pages.pool.num_free
        if not self.pages.allocate(SCRATCH_SEQ, 1):
            raise CacheCapacityError("no free page for the static decode step's scratch page")
        self.scratch_pages = free - self.pages.pool.num_free
        self.memory = replace(self.memory, num_pages=self.memory.num_pages - self.scratch_pages)

    def static_decode(self, rows: int, max_tokens: int) -> FullStaticDecode:
        self.set_aside_scratch_pages()
        return FullStaticDecode(self.pages, self.check_batch, self.device, rows, -(-max_tokens // self.block_size))

    def fused_decode_target(self, cache_layer: int, meta: FullStepMetadata) -> FullFusedTarget | None:
        """The layer's pages and its group's plan when the step is decode only with every row
        a sequence in order (so `write` would store every row at `write_slots` and `attend`
        would call the CPU kernel on the whole batch), the pages are 16/32-bit and the CPU
        kernel is used; else None. The op then does exactly what `write` and `attend` would
        (bitwise), so nothing of this layer is left in `meta.step_kv`. A layer whose K/V
        `write` already kept this step (SwiftKV's later layers) hands them on as `step_kv`."""
        if (self.k_scales is not None or self.config.decode_kernel != "auto" or self.device.type != "cpu"
                or not cpu_kernels_available()):
            return None
        group, index = self.groups.slot_of[cache_layer]
        plan = meta.groups[group]
        d = plan.decode
        if d is None or not d.every_row or plan.write_rows is not None:
            return None
        return FullFusedTarget(self.k_store[index], self.v_store[index],
                               (plan.write_slots, d.page_table, d.first_page_position, d.visible_from, d.visible_to),
                               (self.layout.specs[cache_layer].scale,), meta.step_kv.get(cache_layer))

    def attend(self, cache_layer: int, meta: FullStepMetadata, q: torch.Tensor,
               rope: PositionedRope) -> torch.Tensor:
        queries = {span.seq_id: (span.query_start, span.query_len) for span in meta.batch.spans}
        return self._attend(cache_layer, meta, q, queries)

    def attend_rows(self, cache_layer: int, meta: FullStepMetadata, q: torch.Tensor, rope: PositionedRope,
                    rows: torch.Tensor) -> torch.Tensor:
        if meta.row_queries is None:  # the same rows for every later layer: locate them once
            meta.row_queries = (rows, locate_rows(meta, rows, self.device))
        if meta.row_queries[0] is not rows or meta.row_queries[1] is None:
            # other rows than planned, or not trailing runs per span: the generic path
            return super().attend_rows(cache_layer, meta, q, rope, rows)
        located = meta.row_queries[1]
        return self._attend(cache_layer, meta, q, located.queries, located)

    def _attend(self, cache_layer: int, meta: FullStepMetadata, q: torch.Tensor,
                queries: dict[int, tuple[int, int]], located: RowQueries | None = None) -> torch.Tensor:
        """Attention for the query rows of each sequence: `queries[seq] = (first row in q,
        count)`, the last `count` tokens of the sequence's span (every token unless `located`
        places the decode queries among fewer rows)."""
        spec = self.layout.specs[cache_layer]
        group, index = self.groups.slot_of[cache_layer]
        plan = meta.groups[group]
        k_new, v_new = meta.step_kv[cache_layer]
        k_pages, v_pages = self.k_store[index], self.v_store[index]
        k_scales = self.k_scales[index] if self.k_scales is not None else None
        v_scales = self.v_scales[index] if self.v_scales is not None else None
        if plan.decode is not None and plan.decode.every_row and located is None:  # decode only: no gather/scatter
            return self._decode_attention(plan.decode, q, k_new, v_new, k_pages, v_pages, k_scales, v_scales,
                                          spec.scale)
        # With `located`, one spare row past the end receives the dropped decode results.
        out = q.new_empty((q.shape[0] + (located is not None), *q.shape[1:]))
        for prefill in plan.prefills:
            span = prefill.span
            first, count = queries[span.seq_id]
            if count == 0:
                continue
            own = slice(span.query_start, span.query_end)
            k, v = k_new[own].transpose(0, 1), v_new[own].transpose(0, 1)  # head-major
            past_from = prefill.past_from
            if span.cached_len > past_from:
                skip = past_from - prefill.first_page_position
                length = span.cached_len - past_from
                past_k = _gather_rows(k_pages, k_scales, prefill.pages)[:, skip:skip + length]
                past_v = _gather_rows(v_pages, v_scales, prefill.pages)[:, skip:skip + length]
                k = torch.cat((past_k.to(k.dtype), k), dim=1)
                v = torch.cat((past_v.to(v.dtype), v), dim=1)
            else:
                past_from = span.cached_len
            rows = slice(first, first + count)
            out[rows] = chunk_attention(q[rows], k, v, span.total_len - count, past_from, spec.scale,
                                        spec.sliding_window)
        if plan.decode is not None:
            d = plan.decode
            if located is None:
                q_dec, write = q[d.rows], d.rows
            else:  # a one-token span without a requested row gets a zero query, then is dropped
                q_dec, write = q[located.read] * located.keep, located.write
            out[write] = self._decode_attention(d, q_dec, k_new[d.rows], v_new[d.rows], k_pages, v_pages,
                                                k_scales, v_scales, spec.scale)
        return out if located is None else out[:-1]

    def _decode_attention(self, d: DecodePlan, q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
                          k_pages: torch.Tensor, v_pages: torch.Tensor, k_scales: torch.Tensor | None,
                          v_scales: torch.Tensor | None, scale: float) -> torch.Tensor:
        """One query per decode sequence (row i of q is sequence i of `d`), [B, heads, D]."""
        args = (q, k_self, v_self, k_pages, v_pages, d.page_table, d.first_page_position, d.visible_from,
                d.visible_to, scale)
        kernel = self.decode_kernel
        if kernel == "triton":  # pages in place, one launch (two with split-K); 16/32-bit pages only
            return triton_module().paged_decode_attention_triton(*args)
        if kernel == "auto" and q.device.type == "cpu" and cpu_kernels_available():
            return paged_decode_attention_cpu(*args, k_scales=k_scales, v_scales=v_scales)  # pages in place
        if kernel == "gather" or (kernel == "auto" and q.device.type != "cpu" and self._gather_fits(d, q, k_pages)):
            return gathered_decode_attention(*args, k_scales=k_scales, v_scales=v_scales, hidden=d.hidden)
        return decode_attention(*args, tile_pages=max(1, self.config.decode_tile_tokens // self.block_size),
                                k_scales=k_scales, v_scales=v_scales)

    def _gather_fits(self, d: DecodePlan, q: torch.Tensor, k_pages: torch.Tensor) -> bool:
        """Whether `auto` may take the gathered path: compact tables and a K (or V) copy of at
        most decode_gather_max_bytes (shapes only: deciding never synchronises)."""
        batch, width = d.page_table.shape
        rows = batch * width * k_pages.shape[2] * k_pages.shape[0]  # [kv_heads, B, W * block]
        element = max(q.element_size(), 4 if k_pages.element_size() == 1 else k_pages.element_size())
        return d.compact_tables and rows * k_pages.shape[-1] * element <= self.config.decode_gather_max_bytes


def _gather_rows(pages: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Rows of pages `ids` in order, [kv_heads, tokens, D]: as stored, or dequantised
    (float32) when the pages hold float8 codes with their `scales`."""
    rows = select_pages(pages, ids).flatten(1, 2)
    return rows if scales is None else dequantize(rows, scales.index_select(1, ids).flatten(1, 2))
