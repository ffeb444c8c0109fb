"""The `kivi` cache method (Liu et al., ICML 2024): 2/4/8-bit asymmetric K/V quantisation.

Keys are quantised per channel over groups of G tokens, values per token over groups of G
channels (arithmetic in quant.py, tensors in store.py). The newest tokens stay in full
precision: the key residual collects up to R - 1 tokens and is quantised as R / G pages when
it reaches R; the value residual is a sliding window of the last R tokens, the oldest
leaving it quantised per token. With n tokens held, keys of [0, nk) and values of [0, nv)
are quantised, nk = (n // R) * R, nv = max(0, n - R).

Pages (block_size = G) come from a PageTable over one BlockPool, as in `full`, and are held
only for tokens [0, nk) (whole pages, since R % G == 0). Sliding-window layer groups release
pages that no later query can see. Each sequence also owns one residual slot (K and V, R
tokens, every cache layer, in residual_dtype), costing `slot_pages` pages of the budget.
The budget is split once, at construction, between the two (device memory is the budget:
on CUDA every `torch.empty` costs its whole size, so residual rings and pages cannot both be
sized from the whole budget): `num_slots` rings (`max_sequences`; by default as many as
a quarter of the budget's pages pay for: SLOT_SHARE) and the quantised pages the rest holds. A sequence takes
a free slot when first allocated and returns it in `free`; usage and capacity count a slot
as `slot_pages` pages, so `kv_budget` bounds pages and residuals together and the device
holds at most the budget (no overhead: a ring is at most `slot_pages` pages' bytes).

Multi-token spans (prefill chunks) are attended by prefill.kivi_chunk_attention_fast
(fused attention per part, merged by log-sum-exp; `prefill_attention=reference` selects the
plain PyTorch path of attention.py); single tokens by the kernel `decode_kernel` resolves to
when the cache is built (decode_kernels.py: Triton on CUDA, C++ on CPU, or PyTorch).

Beyond the paper (kivi options, defaults off): separate key/value group sizes (the page
size is key_group); `sinks` (the first N tokens of a sequence kept exact in per-slot sink
buffers, part of the slot's cost, and left out of the range of the key page they share);
`key_space=pre_rope` (pages and rings hold pre-RoPE keys, readers apply RoPE after
dequantisation: key_space.py); `rotation` (rotation.py: keys/values stored rotated by an
orthonormal Hadamard matrix H; post-RoPE rotated keys are matched by attending with q H,
rotated values by multiplying the attention output by H^T).

Step protocol (the step's metadata: plan.py, built by planner.py; token counts and the
memory declaration: memory.py): `write` keeps the step's K/V as stored in the metadata
(and the attention keys when they differ); `attend` reads the state as it was before the
step plus the step's own exact K/V; `end_step` first quantises the tokens that
leave the residuals in this step into their (new) pages, reading the old residuals (one
call per layer group, every layer at once), then writes the step's tokens that stay in the
residuals (only then can ring slots be overwritten) and commits the lengths.
"""

from __future__ import annotations

import math

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.base import CacheMethod
from kvforge.cache.block_pool import BlockPool
from kvforge.cache.kivi.attention import kivi_chunk_attention
from kvforge.cache.kivi.config import RESIDUAL_DTYPES, KIVICacheConfig, default_residual_dtype
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available
from kvforge.cache.kivi.decode_kernels import kivi_decode, resolve_decode_kernel
from kvforge.cache.kivi.fused_target import KiviFusedTarget, layer_target
from kvforge.cache.kivi.key_space import KeyTransform, StoredKeys
from kvforge.cache.kivi.memory import KiviMemorySpec, quantized_keys, quantized_values
from kvforge.cache.kivi.plan import Decode, GroupPlan, KiviStepMetadata, ResidualWrites, SequenceState
from kvforge.cache.kivi.planner import KiviPlanner
from kvforge.cache.kivi.prefill import kivi_chunk_attention_fast
from kvforge.cache.kivi.rotation import hadamard_matrix, rotate, unrotate
from kvforge.cache.kivi.static_decode import KiviStaticDecode
from kvforge.cache.kivi.step_writes import flush_group, write_residuals
from kvforge.cache.kivi.store import KIVILayerView, KIVIStore, page_bytes
from kvforge.cache.layout import CacheLayout
from kvforge.cache.page_table import LayerGroups, PageTable
from kvforge.cache.registry import register_cache_method
from kvforge.errors import ConfigError
from kvforge.rope import PositionedRope
from kvforge.step_plan import upload

# Default split of the budget (max_sequences=None): 1 / SLOT_SHARE of it pays for residual
# slots. A 2-bit sequence of n tokens costs one slot (R tokens at 16 bits, about 5.3 R
# tokens' worth of pages) plus n tokens of pages, so a quarter balances slots and pages for
# sequences of about 16 R = 2,048 tokens, the long contexts KIVI is for (half balanced them
# at ~700 tokens and held fewer long sequences: docs/benchmarks.md#kvforgecachekivi).
# Shorter workloads set max_sequences.
SLOT_SHARE = 4


@register_cache_method("kivi", KIVICacheConfig)
class KIVICache(CacheMethod[KiviStepMetadata]):
    def __init__(self, layout: CacheLayout, config: KIVICacheConfig, budget_bytes: int,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(layout, compute_dtype, device)
        self.config = config
        self.can_fork = config.prefix_reuse == "snapshot"
        self.decode_kernel = resolve_decode_kernel(config.decode_kernel, self.device, config)
        g, vg, r, bits = config.key_tokens, config.value_channels, config.residual, config.bits
        heads, dim = layout.num_kv_heads, layout.head_dim
        if dim % vg:
            name = "value_group" if config.value_group is not None else "group"
            raise ConfigError(name, vg, f"must divide head_dim={dim} (values are grouped over channels)")
        self.rotation = hadamard_matrix(dim, self.device) if config.rotation != "none" else None
        self.residual_dtype = RESIDUAL_DTYPES[config.residual_dtype] if config.residual_dtype \
            else default_residual_dtype(compute_dtype)
        self.groups = LayerGroups.from_layout(layout)
        bits, value_bits = config.kbits, config.vbits
        self.page_bytes = page_bytes(self.groups.group_size, heads, dim, bits, g, vg, value_bits)
        element = torch.tensor([], dtype=self.residual_dtype).element_size()
        # A slot: the K/V residual rings (R tokens) and the sink buffers (sinks tokens).
        self.residual_bytes = 2 * layout.num_cache_layers * heads * (r + config.sinks) * dim * element
        self.slot_pages = math.ceil(self.residual_bytes / self.page_bytes)
        budget_pages = budget_bytes // self.page_bytes
        least_pages = self.groups.num_groups * r // g  # one residual's worth of quantised keys
        minimum = (self.slot_pages + least_pages) * self.page_bytes
        if budget_pages * self.page_bytes < minimum:
            raise ConfigError("kv_budget", budget_bytes,
                              f"must hold one sequence's residual ({self.residual_bytes} bytes) plus one "
                              f"residual's worth of quantised pages: at least {minimum} bytes")
        if config.max_sequences is None:
            num_slots = max(1, min(budget_pages // SLOT_SHARE, budget_pages - least_pages) // self.slot_pages)
        else:
            num_slots = config.max_sequences
            most = (budget_pages - least_pages) // self.slot_pages
            if num_slots > most:
                raise ConfigError("max_sequences", num_slots,
                                  f"must be <= {most}: each residual slot costs {self.slot_pages} pages of "
                                  f"{self.page_bytes} bytes and kv_budget={budget_bytes} must also hold "
                                  f"{least_pages} quantised pages")
        self.num_slots = num_slots
        num_pages = budget_pages - num_slots * self.slot_pages
        self.budget_bytes = budget_bytes
        self.pages = PageTable(BlockPool(num_pages), g, self.groups)
        self.store = KIVIStore(self.groups.group_size, layout.num_cache_layers, heads, dim, num_pages, num_slots,
                               bits, g, r, self.residual_dtype, self.device, value_group=vg, sinks=config.sinks,
                               value_bits=value_bits)
        self.memory = KiviMemorySpec(layout.num_cache_layers, self.groups, g, r, self.page_bytes, self.slot_pages,
                                     num_slots, num_pages)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._seqs: dict[int, SequenceState] = {}
        self._planner = KiviPlanner(config, self.pages, self._seqs)

    # -- token counts -------------------------------------------------------------------
    def quantized_keys(self, num_tokens: int) -> int:
        """nk: tokens whose keys are quantised when a sequence holds `num_tokens`."""
        return quantized_keys(num_tokens, self.config.residual)

    def quantized_values(self, num_tokens: int) -> int:
        """nv: tokens whose values are quantised when a sequence holds `num_tokens`."""
        return quantized_values(num_tokens, self.config.residual)

    # -- allocator --------------------------------------------------------------------
    def memory_usage(self) -> dict[str, int]:
        used = self.pages.pool.num_used + self.slot_pages * len(self._seqs)
        return {"fast": used * self.page_bytes, "slow": 0}

    def statistics(self) -> dict[str, float]:
        pool = self.pages.pool
        reserved = self.slot_pages * len(self._seqs)
        return {"pages_used": pool.num_used, "pages_total": pool.num_blocks, "residual_pages": reserved,
                "residual_slots": self.num_slots,
                "sequences": len(self._seqs), "bytes_per_token_ratio_vs_fp16":
                    self.memory.kv_bytes_per_token() / (4 * self.layout.num_cache_layers * self.layout.num_kv_heads
                                                 * self.layout.head_dim)}

    def _fits(self, seq_id: int, num_tokens: int) -> bool:
        if seq_id not in self._seqs and not self._free_slots:
            return False
        return self.pages.can_allocate(seq_id, self.quantized_keys(num_tokens))

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        if not self._fits(seq_id, num_tokens):
            return False
        if seq_id not in self._seqs:
            self._seqs[seq_id] = SequenceState(self._free_slots.pop())
        allocated = self.pages.allocate(seq_id, self.quantized_keys(num_tokens))
        assert allocated, "checked by _fits"
        return True

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self.pages.free(seq_id)
        self._free_slots.append(seq.slot)

    # Quantised pages are final for tokens below nk: their keys are written once, and a
    # value slot is written once, when its token leaves the value residual, with bytes that
    # depend on that token's value alone. So a fork shares those pages (reference counts)
    # and copies only the residual rings; whichever sequence later writes a shared page's
    # value slot writes the same bytes. (`can_fork` is False with prefix_reuse=continue.)

    def fork(self, source: int, target: int) -> bool:
        if target in self._seqs:
            raise ConfigError("seq_id", target, "must not hold storage yet to be forked into")
        seq = self._seqs[source]
        if not self._free_slots:
            return False
        stored = self.quantized_keys(seq.num_tokens)
        logical = stored // self.config.key_tokens
        tables = [self.pages.pages(source, g)[:logical] for g in range(self.groups.num_groups)]
        self.pages.attach(target, stored, tables)
        fork = SequenceState(self._free_slots.pop(), seq.num_tokens)
        self._seqs[target] = fork
        for buffer in (self.store.k_res, self.store.v_res, self.store.k_sink, self.store.v_sink):
            if buffer is not None:
                buffer[:, fork.slot] = buffer[:, seq.slot]
        return True

    def num_cached_tokens(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return seq.num_tokens if seq else 0

    def residual_slot(self, seq_id: int) -> int:
        return self._seqs[seq_id].slot

    # -- step -------------------------------------------------------------------------
    def begin_step(self, batch: ForwardBatch) -> KiviStepMetadata:
        return KiviStepMetadata(batch, *upload(self.host_plan(batch), self.device))

    def host_plan(self, batch: ForwardBatch) -> tuple[list[GroupPlan], ResidualWrites]:
        """`begin_step`'s checks and plan, as host tensors (the static decode step pads them)."""
        self.check_batch(batch)
        missing = [span.seq_id for span in batch.spans if span.seq_id not in self._seqs]
        if missing:
            raise ConfigError("seq_id", missing[0], "call allocate() for the step before running it")
        return self._planner.on_host(batch)

    def static_decode(self, rows: int, max_tokens: int) -> KiviStaticDecode:
        return KiviStaticDecode(self.host_plan, self.groups.num_groups, self.device, rows,
                                -(-max_tokens // self.config.key_tokens))

    def write(self, cache_layer: int, meta: KiviStepMetadata, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        # Tokens leaving the residuals are quantised at end_step, all layers of a group in one
        # call: attend never reads them from pages in this step (it reads the state before it).
        k_post = rope.apply(k_pre)
        pre = self.config.key_space == "pre_rope"
        keys = k_pre if pre else k_post
        if self.rotation is not None and self.config.rotates_keys:
            keys = rotate(keys, self.rotation)
        if self.rotation is not None and self.config.rotates_values:
            v = rotate(v, self.rotation)
        meta.step_kv[cache_layer] = (keys, v)
        if pre:
            meta.attention_keys[cache_layer] = k_post

    def attend(self, cache_layer: int, meta: KiviStepMetadata, q: torch.Tensor,
               rope: PositionedRope) -> torch.Tensor:
        spec = self.layout.specs[cache_layer]
        group, index = self.groups.slot_of[cache_layer]
        plan = meta.groups[group]
        view = self.store.layer(index, cache_layer)
        k_new, v_new = meta.step_kv[cache_layer]
        k_new = meta.attention_keys.get(cache_layer, k_new)
        key_transform = None
        if self.config.key_space == "pre_rope":
            key_transform = StoredKeys(rope.rotary, self.rotation if self.config.rotates_keys else None)
        elif self.rotation is not None and self.config.rotates_keys:
            q = rotate(q, self.rotation)  # q H . k H = q . k
        decode = plan.decode
        if decode is not None and not plan.prefills and decode.rows_in_order and q.shape[0] == decode.lengths.shape[0]:
            # Every row of the step decodes, in order: no gather of q/k/v, no scatter of out.
            out = self._decode(decode, q, k_new, v_new, view, spec.scale, key_transform).to(q.dtype)
            return unrotate(out, self.rotation) if self.rotation is not None and self.config.rotates_values else out
        out = torch.empty_like(q)
        tile = max(1, self.config.prefill_tile_tokens // self.config.key_tokens)
        chunk_attention = kivi_chunk_attention_fast if self.config.prefill_attention == "blockwise" \
            else kivi_chunk_attention
        for p in plan.prefills:
            rows = slice(p.span.query_start, p.span.query_end)
            out[rows] = chunk_attention(q[rows], k_new[rows], v_new[rows], view, p.pages,
                                        p.first_page_position, p.past_from, p.span.cached_len, p.slot,
                                        spec.scale, spec.sliding_window, tile, key_transform)
        if decode is not None:
            out[decode.rows] = self._decode(decode, q[decode.rows], k_new[decode.rows], v_new[decode.rows], view,
                                            spec.scale, key_transform)
        if self.rotation is not None and self.config.rotates_values:
            out = unrotate(out, self.rotation)  # (P V H) H^T = P V
        return out

    def fused_decode_target(self, cache_layer: int, meta: KiviStepMetadata) -> KiviFusedTarget | None:
        """This layer's storage, plan and kernel settings for the fused decode op, when the
        step is decode only with its rows in order and `attend` would call the C++ kernel on
        q, k and v as they are: post-RoPE stored keys, no rotation, `decode_kernel=cpp`,
        contiguous int64 plan tensors; else None. The op does exactly what `write` and
        `attend` would (bitwise) and hands k and v back to `meta.step_kv`."""
        if (self.decode_kernel != "cpp" or self.rotation is not None or self.config.key_space != "post_rope"
                or not cpu_kivi_kernel_available()):
            return None
        group, index = self.groups.slot_of[cache_layer]
        plan = meta.groups[group]
        d = plan.decode
        if d is None or plan.prefills or not d.rows_in_order:
            return None
        return layer_target(cache_layer, self.store.layer(index, cache_layer), d, self.layout.specs[cache_layer].scale,
                            self.config.key_dot, self.config.value_dot, meta)

    def _decode(self, d: Decode, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, view: KIVILayerView,
                scale: float, key_transform: KeyTransform) -> torch.Tensor:
        """Decode attention of the plan's decode rows (q, k_new, v_new: those rows, in order)."""
        return kivi_decode(self.decode_kernel, q, k_new, v_new, view, d.page_table, d.first_page_position,
                           d.visible_from, d.lengths, d.slots, scale,
                           tile_pages=max(1, self.config.decode_tile_tokens // self.config.key_tokens),
                           key_transform=key_transform, key_dot=self.config.key_dot, value_dot=self.config.value_dot,
                           residual_split=d.residual_split(view.residual) if self.decode_kernel == "triton" else None)

    def end_step(self, meta: KiviStepMetadata) -> None:
        for group in range(self.groups.num_groups):  # before the residual writes overwrite the rings
            flush_group(self.store, meta.groups[group].flush, self.groups.layers[group], meta.step_kv,
                        self.residual_dtype, self.device)
        write_residuals(self.store, meta.residual_writes, meta.step_kv, self.residual_dtype, self.device)
        for span in meta.batch.spans:
            self._seqs[span.seq_id].num_tokens = span.total_len
            self.pages.commit(span.seq_id, self.quantized_keys(span.total_len))
