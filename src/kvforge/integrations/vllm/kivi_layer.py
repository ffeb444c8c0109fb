"""The tensor work of the vLLM KIVI backend (torch and kvforge only, no vLLM import, so the
default suite drives it against kvforge's own KIVI cache: tests/integrations/test_vllm_kivi_layer.py).

- `step_metadata`: once per step, from the per-sequence counts and block tables vLLM's
  metadata gives, the exact-copy plan (kivi_exact.py) and its index tensors;
- `KIVILayerStorage`: one layer's pages, sink area and exact copies over its byte region of
  vLLM's KV cache (kivi_pages.py); `write` keeps the step's new tokens exact (copies,
  sinks) and quantises every block completed in the step into its page with kvforge's
  writers; `attend` reads the state before the step plus the step's own exact K/V through
  kvforge's attention (`kivi_decode` for decode-only steps, `kivi_chunk_attention_fast`
  per sequence otherwise), in the stored form of kivi_stored.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.cache.kivi.config import KIVICacheConfig
from kvforge.cache.kivi.decode_kernels import kivi_decode
from kvforge.cache.kivi.prefill import kivi_chunk_attention_fast
from kvforge.cache.kivi.store import (
    dequantize_key_pages,
    dequantize_value_pages,
    store_key_pages,
    store_value_tokens,
)
from kvforge.integrations.vllm.kivi_exact import MISSING, ExactCopies, ExactPlan, SequenceStep, exact_slots
from kvforge.integrations.vllm.kivi_options import page_block_bytes, sink_block_bytes
from kvforge.integrations.vllm.kivi_pages import ExactPool, SinkArea, layer_view, page_components
from kvforge.integrations.vllm.kivi_stored import StoredForm

PLAN_TENSORS = ("write_rows", "write_slots", "write_offsets", "full_blocks", "full_sources", "sink_rows",
                "sink_blocks", "sink_tokens", "key_fill_to", "key_fill_from")


@dataclass
class KIVIMetadata:
    num_actual_tokens: int
    query_start: list[int]  # per sequence, first row of its step tokens
    query_lens: list[int]
    stored: list[int]  # tokens held before the step
    block_table: torch.Tensor  # [B, W] int64
    plan: ExactPlan
    tensors: dict[str, torch.Tensor]  # the plan's index tensors and each row's position, on the device
    decode_only: bool


def step_metadata(copies: ExactCopies, starts: Sequence[int], seq_lens: Sequence[int], block_table: torch.Tensor,
                  num_actual_tokens: int) -> KIVIMetadata:
    """The step's metadata: `starts` [B + 1] the first row of each sequence (and the end),
    `seq_lens` [B] its tokens after the step, `block_table` [B, W] its blocks."""
    num_reqs = len(seq_lens)
    query_lens = [starts[i + 1] - starts[i] for i in range(num_reqs)]
    stored = [seq_lens[i] - query_lens[i] for i in range(num_reqs)]
    table = block_table[:num_reqs].to(torch.int64)
    rows = table.cpu().tolist()
    plan = copies.plan([SequenceStep(stored[i], query_lens[i], starts[i], rows[i]) for i in range(num_reqs)])
    device = table.device
    as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    tensors = {name: as_long(getattr(plan, name)) for name in PLAN_TENSORS}
    tensors["ring_sources"] = as_long(plan.ring_sources).view(num_reqs, copies.residual)
    # each row's position in its sequence, stored + offset in the step (pre-RoPE keys need it)
    lengths = torch.tensor(query_lens, dtype=torch.int64)
    first_position = torch.tensor(stored, dtype=torch.int64) - torch.tensor(list(starts[:num_reqs]), dtype=torch.int64)
    tensors["positions"] = (torch.arange(int(lengths.sum())) + first_position.repeat_interleave(lengths)).to(device)
    return KIVIMetadata(num_actual_tokens, list(starts[:num_reqs]), query_lens, stored, table, plan, tensors,
                        decode_only=bool(num_reqs) and max(query_lens) == 1)


# The exact copies over each region, by its data pointer: a KV-sharing layer's storage is
# its owner's region, whose copies must not be made (and zeroed) twice.
_POOLS: dict[int, ExactPool] = {}


class KIVILayerStorage:
    """One cache layer of the backend: `bind` lays the pages, the sink areas and the exact
    copies over the layer's region; `write` and `attend` are the step's two halves."""

    def __init__(self, config: KIVICacheConfig, kv_heads: int, head_dim: int, residual_dtype: torch.dtype,
                 max_num_seqs: int, form: StoredForm, decode_kernel: str) -> None:
        self.config, self.kv_heads, self.head_dim = config, kv_heads, head_dim
        self.residual_dtype, self.max_num_seqs, self.form, self.kernel = residual_dtype, max_num_seqs, form, decode_kernel
        self.page = page_block_bytes(config, kv_heads, head_dim)
        element = torch.tensor([], dtype=residual_dtype).element_size()
        self.sink_bytes = sink_block_bytes(config, kv_heads, head_dim, element)
        self.parts: dict[str, torch.Tensor] = {}
        self.sinks: SinkArea | None = None
        self.pool: ExactPool | None = None
        self._bound: int | None = None

    def bind(self, region: torch.Tensor, num_blocks: int) -> None:
        """The region [num_blocks * declared bytes] is the pages, then (with sinks) the
        blocks' sink areas, then the exact copies in the spare bytes the declared block size
        adds (kivi_options.block_bytes_with_copies)."""
        key = region.data_ptr()
        if self._bound == key:
            return
        pages_end = num_blocks * self.page
        sinks_end = pages_end + num_blocks * self.sink_bytes
        self.parts = page_components(region[:pages_end], self.config, num_blocks, self.kv_heads, self.head_dim)
        self.sinks = SinkArea(num_blocks, self.config.sinks, self.kv_heads, self.head_dim, self.residual_dtype,
                              region[pages_end:sinks_end]) if self.config.sinks else None
        pool = _POOLS.get(key)
        if pool is None:
            slots = exact_slots(self.config.key_tokens, self.config.residual, self.max_num_seqs)
            pool = _POOLS[key] = ExactPool(slots, self.config.key_tokens, self.kv_heads, self.head_dim,
                                           self.residual_dtype, region.device, storage=region[sinks_end:])
        self.pool = pool
        self._bound = key

    def _pool(self) -> ExactPool:
        assert self.pool is not None, "call bind() first"
        return self.pool

    def write(self, meta: KIVIMetadata, key: torch.Tensor, value: torch.Tensor) -> None:
        """The step's rows (vLLM's post-RoPE keys and values [n, H, D]) into storage."""
        pool, t = self._pool(), meta.tensors
        exact_k = self.form.stored_keys(key, t["positions"]).to(self.residual_dtype)
        exact_v = self.form.values(value).to(self.residual_dtype)
        if t["full_blocks"].numel():
            # quantised from the residual dtype, as kvforge's flush reads its ring
            keys, values = pool.gather(t["full_sources"], exact_k, exact_v)
            if t["key_fill_to"].numel():  # a first block's sinks: out of its keys' range
                keys = keys.index_copy(0, t["key_fill_to"], keys.index_select(0, t["key_fill_from"]))
            view = layer_view(self.parts, self.config, pool.keys[:0], pool.values[:0])
            store_key_pages(view, keys, t["full_blocks"])
            g = self.config.key_tokens
            flat = (t["full_blocks"][:, None] * g + torch.arange(g, device=keys.device)).reshape(-1)
            store_value_tokens(view, values, flat)
        if t["write_rows"].numel():
            pool.write(t["write_slots"], t["write_offsets"], exact_k[t["write_rows"]], exact_v[t["write_rows"]])
        if self.sinks is not None and t["sink_rows"].numel():
            self.sinks.write(t["sink_blocks"], t["sink_tokens"], exact_k[t["sink_rows"]], exact_v[t["sink_rows"]])

    def attend(self, meta: KIVIMetadata, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Attention [n, heads, D] of the step's queries (vLLM's, post-RoPE) over the state
        before the step plus the step's own keys and values (vLLM's)."""
        form, n = self.form, meta.num_actual_tokens
        key, value, query = form.attention_keys(key[:n]), form.values(value[:n]), form.queries(query[:n])
        sinks = self.sinks.of(meta.block_table[:, 0]) if self.sinks is not None else None
        ring_k, ring_v = self._rings(meta, sinks)
        view = layer_view(self.parts, self.config, ring_k, ring_v, sinks)
        transform = form.key_transform()
        g, r = self.config.key_tokens, self.config.residual
        if meta.decode_only:
            batch = len(meta.stored)
            stored = torch.tensor(meta.stored, dtype=torch.int64, device=query.device)
            table = meta.block_table[:, :max(1, (max(meta.stored) // r) * r // g)]
            zeros = torch.zeros(batch, dtype=torch.int64, device=query.device)
            out = kivi_decode(self.kernel, query, key, value, view, table, zeros, zeros, stored,
                              torch.arange(batch, device=query.device), scale,
                              max(1, self.config.decode_tile_tokens // g), key_transform=transform)
            return form.output(out)
        out = torch.empty_like(query)
        for i, (start, length, stored_len) in enumerate(zip(meta.query_start, meta.query_lens, meta.stored,
                                                            strict=True)):
            rows = slice(start, start + length)
            nk = (stored_len // r) * r
            out[rows] = kivi_chunk_attention_fast(query[rows], key[rows], value[rows], view,
                                                  meta.block_table[i, :nk // g], 0, 0, stored_len, i, scale, None,
                                                  max(1, self.config.prefill_tile_tokens // g), transform)
        return form.output(out)

    def _rings(self, meta: KIVIMetadata, sinks: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """kvforge's rings [B, H, R, D] before the step, gathered from the exact copies; a
        position whose copy is gone is read from its page (a sink token from its sink area)."""
        pool = self._pool()
        sources = meta.tensors["ring_sources"]
        batch, r = sources.shape
        keys, values = pool.gather(sources.clamp(min=0).reshape(-1), pool.keys[:0].flatten(0, 1),
                                   pool.values[:0].flatten(0, 1))
        keys = keys.view(batch, r, self.kv_heads, self.head_dim)
        values = values.view(batch, r, self.kv_heads, self.head_dim)
        if meta.plan.any_missing:
            keys, values = self._fill_missing(meta, keys, values, sinks)
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    def _fill_missing(self, meta: KIVIMetadata, keys: torch.Tensor, values: torch.Tensor,
                      sinks: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        g, r = self.config.key_tokens, self.config.residual
        view = layer_view(self.parts, self.config, keys[:0], values[:0])
        for i, ring in enumerate(meta.plan.ring_sources):
            for offset, source in enumerate(ring):
                if source != MISSING:
                    continue
                stored = meta.stored[i]
                position = stored - 1 - ((stored - 1 - offset) % r)  # the token at this ring offset
                if sinks is not None and position < self.config.sinks:  # its page holds token N's key
                    keys[i, offset] = sinks[0][i, :, position].to(keys.dtype)
                    values[i, offset] = sinks[1][i, :, position].to(values.dtype)
                    continue
                block = meta.block_table[i, position // g].reshape(1)
                keys[i, offset] = dequantize_key_pages(view, block)[:, position % g].to(keys.dtype)
                values[i, offset] = dequantize_value_pages(view, block)[:, position % g].to(values.dtype)
        return keys, values
