"""kvforge's KIVI as a vLLM attention backend (imports vLLM; registered by `register()` as
`--attention-backend CUSTOM`).

Roles, as vLLM v1 splits them:
- `KIVIAttentionBackend` (static): the KV cache spec via `customize_spec`: vLLM's own
  FullAttentionSpec with one head slot of `declared / G` bytes per token
  (`state_content_bytes`), declared = the packed page plus its share of the exact copies
  (kivi_options.block_bytes_with_copies), so vLLM's block manager divides the KV memory by
  what pages and copies cost together; one fixed kernel block size G (a block is one
  kvforge page); layer-outermost layout, so each layer's pages, then its copies, are one
  contiguous byte region (kivi_pages.py).
- `KIVIMetadataBuilder`: once per step, the per-sequence counts and the exact-copy plan
  (kivi_exact.py), shared by every layer of the step.
- `KIVIAttentionImpl`: `do_kv_cache_update` keeps the step's new tokens exact (copies) and
  quantises every block completed in the step into its page with kvforge's writers
  (`store_key_pages`, `store_value_tokens`); `forward` attends with kvforge's code over the
  state before the step plus the step's own exact K/V: decode-only steps through
  `kivi_decode` (the C++ kernel on CPU, the Triton kernel on CUDA), other steps per sequence
  through `kivi_chunk_attention_fast`. KV-sharing layers (SwiftKV's later layers) get no
  K/V of their own and read the exact K/V their cache owner stored in the same step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvforge.cache.kivi.config import RESIDUAL_DTYPES, KIVICacheConfig
from kvforge.cache.kivi.decode_kernels import kivi_decode, resolve_decode_kernel
from kvforge.cache.kivi.prefill import kivi_chunk_attention_fast
from kvforge.cache.kivi.store import (
    dequantize_key_pages,
    dequantize_value_pages,
    store_key_pages,
    store_value_tokens,
)
from kvforge.errors import ConfigError
from kvforge.integrations.vllm.kivi_exact import MISSING, ExactCopies, ExactPlan, SequenceStep, exact_slots
from kvforge.integrations.vllm.kivi_options import (
    block_bytes_with_copies,
    copy_pool_bytes,
    kivi_config,
    page_block_bytes,
    residual_dtype_name,
)
from kvforge.integrations.vllm.kivi_pages import ExactPool, layer_bytes, layer_view, page_components

BACKEND_NAME = "CUSTOM"  # vLLM looks the name up in AttentionBackendEnum: the member it is registered as


def _config() -> KIVICacheConfig:
    return kivi_config()


class KIVIAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KIVIAttentionImpl]:
        return KIVIAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KIVIMetadataBuilder]:
        return KIVIMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [_config().key_tokens]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return _config().key_tokens

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # layer-outermost: one contiguous region per layer

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        config = _config()
        declared = _declared_block_bytes(config, spec.num_kv_heads, spec.head_size)
        return dataclasses.replace(spec, dtype=torch.uint8, num_head_slots=1,
                                   state_content_bytes=declared // config.key_tokens)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        declared = _declared_block_bytes(_config(), num_kv_heads, head_size)
        return (num_blocks, 1, block_size, declared // block_size)


# The vLLM config the attention layers were built under: vLLM asks for the spec outside
# any config context, after the model (and so every layer) is built.
_BUILT_WITH: dict[str, VllmConfig] = {}


def _declared_block_bytes(config: KIVICacheConfig, kv_heads: int, head_dim: int) -> int:
    """One page plus its share of the exact copies (kivi_options.block_bytes_with_copies),
    from the current vLLM config: the KV budget, max_num_seqs, the model dtype and the
    layers that own a KV cache (KV-sharing layers own none)."""
    from vllm.model_executor.layers.attention import Attention

    vllm_config = get_current_vllm_config_or_none() or _BUILT_WITH.get("vllm_config")
    if vllm_config is None:
        raise RuntimeError("the KIVI backend's block size needs the vLLM config its layers were built with")
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if budget is None:
        raise ConfigError("kv_cache_memory_bytes", budget,
                          "must be set for the KIVI backend (--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE): "
                          "the exact copies of the residual are taken from it")
    layers = [layer for layer in vllm_config.compilation_config.static_forward_context.values()
              if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name is None]
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    element = torch.tensor([], dtype=RESIDUAL_DTYPES[residual_dtype_name(config, model_dtype)]).element_size()
    pool = copy_pool_bytes(config, kv_heads, head_dim, element, vllm_config.scheduler_config.max_num_seqs)
    page = page_block_bytes(config, kv_heads, head_dim)
    return block_bytes_with_copies(page, pool, budget, max(1, len(layers)), config.key_tokens)


@dataclass
class KIVIMetadata:
    num_actual_tokens: int
    query_start: list[int]  # per sequence, first row of its step tokens
    query_lens: list[int]
    stored: list[int]  # tokens held before the step
    block_table: torch.Tensor  # [B, W] int64
    plan: ExactPlan
    tensors: dict[str, torch.Tensor]  # the plan's index tensors on the device
    decode_only: bool


class KIVIMetadataBuilder(AttentionMetadataBuilder[KIVIMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = _config()
        if kv_cache_spec.block_size != self.config.key_tokens:
            raise ValueError(f"the KIVI backend needs block_size = key group = {self.config.key_tokens}, "
                             f"got {kv_cache_spec.block_size} (pass --block-size {self.config.key_tokens})")
        slots = exact_slots(self.config.key_tokens, self.config.residual, vllm_config.scheduler_config.max_num_seqs)
        self.copies = ExactCopies(slots, self.config.key_tokens, self.config.residual)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KIVIMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        starts = cm.query_start_loc_cpu[:num_reqs + 1].tolist()
        seq_lens = cm.seq_lens.cpu()[:num_reqs].tolist()
        query_lens = [starts[i + 1] - starts[i] for i in range(num_reqs)]
        stored = [seq_lens[i] - query_lens[i] for i in range(num_reqs)]
        table = cm.block_table_tensor[:num_reqs].to(torch.int64)
        rows = table.cpu().tolist()
        plan = self.copies.plan([SequenceStep(stored[i], query_lens[i], starts[i], rows[i])
                                 for i in range(num_reqs)])
        device = cm.query_start_loc.device
        as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        tensors = {"write_rows": as_long(plan.write_rows), "write_slots": as_long(plan.write_slots),
                   "write_offsets": as_long(plan.write_offsets), "full_blocks": as_long(plan.full_blocks),
                   "full_sources": as_long(plan.full_sources),
                   "ring_sources": as_long(plan.ring_sources).view(num_reqs, self.config.residual)}
        return KIVIMetadata(cm.num_actual_tokens, starts[:num_reqs], query_lens, stored, table, plan, tensors,
                            decode_only=bool(num_reqs) and max(query_lens) == 1)


# The step's exact K/V of each cache owner, by the data pointer of its KV cache, for the
# KV-sharing layers that attend over that cache later in the same step.
_STEP_KV: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class KIVIAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap, "sinks": sinks}
        for name, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"kvforge's KIVI vLLM backend does not support {name}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"kvforge's KIVI vLLM backend supports decoder attention only, not {attn_type}")
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.config = _config()
        vllm_config = _BUILT_WITH["vllm_config"] = get_current_vllm_config()
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self.residual_dtype = RESIDUAL_DTYPES[residual_dtype_name(self.config, model_dtype)]
        self.page = page_block_bytes(self.config, num_kv_heads, head_size)
        self._parts: dict[str, torch.Tensor] | None = None
        self._parts_key: int | None = None
        self._pool: ExactPool | None = None
        self._kernel: str | None = None

    # -- storage -------------------------------------------------------------------------
    def _storage(self, kv_cache: torch.Tensor) -> tuple[dict[str, torch.Tensor], ExactPool]:
        """The layer's region [num_blocks * declared bytes] is the pages, then the exact
        copies in the spare bytes the declared block size adds (customize_spec)."""
        key = kv_cache.data_ptr()
        num_blocks = kv_cache.shape[0]
        region = layer_bytes(kv_cache, kv_cache.numel() * kv_cache.element_size())
        pages_end = num_blocks * self.page
        if self._parts is None or self._parts_key != key:
            self._parts = page_components(region[:pages_end], self.config, num_blocks, self.num_kv_heads,
                                          self.head_size)
            self._parts_key = key
            self._kernel = resolve_decode_kernel(self.config.decode_kernel, kv_cache.device, self.config)
        pool = _POOLS.get(key)
        if pool is None:
            slots = exact_slots(self.config.key_tokens, self.config.residual, self.max_num_seqs)
            pool = _POOLS[key] = ExactPool(slots, self.config.key_tokens, self.num_kv_heads, self.head_size,
                                           self.residual_dtype, kv_cache.device, storage=region[pages_end:])
        self._pool = pool
        return self._parts, pool

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        meta = _metadata_of(layer)
        if meta is None or kv_cache.numel() == 0:
            return
        n = meta.num_actual_tokens
        key, value = key[:n], value[:n]
        _STEP_KV[kv_cache.data_ptr()] = (key, value)
        parts, pool = self._storage(kv_cache)
        t = meta.tensors
        exact_k, exact_v = key.to(self.residual_dtype), value.to(self.residual_dtype)
        if t["full_blocks"].numel():
            # quantised from the residual dtype, as kvforge's flush reads its ring
            keys, values = pool.gather(t["full_sources"], exact_k, exact_v)
            view = layer_view(parts, self.config, pool.keys[:0], pool.values[:0])
            store_key_pages(view, keys, t["full_blocks"])
            g = self.config.key_tokens
            flat = (t["full_blocks"][:, None] * g + torch.arange(g, device=keys.device)).reshape(-1)
            store_value_tokens(view, values, flat)
        if t["write_rows"].numel():
            pool.write(t["write_slots"], t["write_offsets"], exact_k[t["write_rows"]], exact_v[t["write_rows"]])

    # -- attention -----------------------------------------------------------------------
    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: KIVIMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        assert output is not None, "the KIVI backend writes into the layer's output buffer"
        if attn_metadata is None or kv_cache.numel() == 0:  # profiling run: no cache yet
            return output.fill_(0)
        meta = attn_metadata
        n = meta.num_actual_tokens
        if key is None or value is None:  # KV-sharing layer: its owner's exact K/V of this step
            key, value = _STEP_KV[kv_cache.data_ptr()]
        key, value, query = key[:n], value[:n], query[:n]
        parts, pool = self._storage(kv_cache)
        ring_k, ring_v = self._rings(meta, parts, pool)
        view = layer_view(parts, self.config, ring_k, ring_v)
        g = self.config.key_tokens
        if meta.decode_only:
            batch = len(meta.stored)
            stored = torch.tensor(meta.stored, dtype=torch.int64, device=query.device)
            nk = (max(meta.stored) // self.config.residual) * self.config.residual
            table = meta.block_table[:, :max(1, nk // g)]
            zeros = torch.zeros(batch, dtype=torch.int64, device=query.device)
            out = kivi_decode(self._kernel or "torch", query, key, value, view, table, zeros, zeros, stored,
                              torch.arange(batch, device=query.device), self.scale,
                              max(1, self.config.decode_tile_tokens // g))
            output[:n] = out.to(output.dtype)
            return output
        for i, (start, length, stored) in enumerate(zip(meta.query_start, meta.query_lens, meta.stored,
                                                        strict=True)):
            rows = slice(start, start + length)
            nk = (stored // self.config.residual) * self.config.residual
            out = kivi_chunk_attention_fast(query[rows], key[rows], value[rows], view, meta.block_table[i, :nk // g],
                                            0, 0, stored, i, self.scale, None,
                                            max(1, self.config.prefill_tile_tokens // g))
            output[rows] = out.to(output.dtype)
        return output

    def _rings(self, meta: KIVIMetadata, parts: dict[str, torch.Tensor], pool: ExactPool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """kvforge's rings [B, H, R, D] before the step, gathered from the exact copies; a
        position whose copy is gone is read from its page."""
        sources = meta.tensors["ring_sources"]
        batch, r = sources.shape
        keys, values = pool.gather(sources.clamp(min=0).reshape(-1), pool.keys[:0].flatten(0, 1),
                                   pool.values[:0].flatten(0, 1))
        keys = keys.view(batch, r, self.num_kv_heads, self.head_size)
        values = values.view(batch, r, self.num_kv_heads, self.head_size)
        if meta.plan.any_missing:
            keys, values = self._fill_missing(meta, parts, keys, values)
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    def _fill_missing(self, meta: KIVIMetadata, parts: dict[str, torch.Tensor], keys: torch.Tensor,
                      values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, r = self.config.key_tokens, self.config.residual
        view = layer_view(parts, self.config, keys[:0], values[:0])
        for i, ring in enumerate(meta.plan.ring_sources):
            for offset, source in enumerate(ring):
                if source != MISSING:
                    continue
                stored = meta.stored[i]
                position = stored - 1 - ((stored - 1 - offset) % r)  # the token at this ring offset
                block = meta.block_table[i, position // g].reshape(1)
                keys[i, offset] = dequantize_key_pages(view, block)[:, position % g].to(keys.dtype)
                values[i, offset] = dequantize_value_pages(view, block)[:, position % g].to(values.dtype)
        return keys, values


_POOLS: dict[int, ExactPool] = {}


def _metadata_of(layer: AttentionLayer) -> KIVIMetadata | None:
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)  # type: ignore[attr-defined]
    return metadata if isinstance(metadata, KIVIMetadata) else None
