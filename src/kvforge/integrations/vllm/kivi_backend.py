"""kvforge's KIVI as a vLLM attention backend (imports vLLM; registered by `register()` as
`--attention-backend CUSTOM`).

Roles, as vLLM v1 splits them:
- `KIVIAttentionBackend` (static): the KV cache spec via `customize_spec`: vLLM's own
  FullAttentionSpec with one head slot of `declared / G` bytes per token
  (`state_content_bytes`), declared = the packed page and its sink area plus its share of the exact copies
  (kivi_options.block_bytes_with_copies), so vLLM's block manager divides the KV memory by
  what pages and copies cost together; one fixed kernel block size G (a block is one
  kvforge page); layer-outermost layout, so each layer's pages, then its copies, are one
  contiguous byte region (kivi_pages.py).
- `KIVIMetadataBuilder`: once per step, the per-sequence counts and the exact-copy plan
  (kivi_layer.step_metadata, kivi_exact.py), shared by every layer of the step.
- `KIVIAttentionImpl`: vLLM glue around kivi_layer.KIVILayerStorage (no vLLM in it, so the
  default suite tests it against kvforge's own cache): `do_kv_cache_update` keeps the step's
  new tokens exact (copies, sinks) and quantises every block completed in the step into its
  page; `forward` attends with kvforge's code over the state before the step plus the
  step's own exact K/V (the C++ decode kernel on CPU, the Triton kernel on CUDA).
  KV-sharing layers (SwiftKV's later layers) get no K/V of their own and read the K/V their
  cache owner was handed in the same step. What is stored of vLLM's post-RoPE keys and
  values (pre-RoPE keys, rotated values) is kivi_stored.StoredForm; sinks live in each
  block's sink area (kivi_pages.SinkArea), read from a sequence's first block.
"""

from __future__ import annotations

import dataclasses
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
from kvforge.cache.kivi.decode_kernels import resolve_decode_kernel
from kvforge.errors import ConfigError
from kvforge.integrations.vllm.kivi_exact import ExactCopies, exact_slots
from kvforge.integrations.vllm.kivi_layer import KIVILayerStorage, KIVIMetadata, step_metadata
from kvforge.integrations.vllm.kivi_options import (
    block_bytes_with_copies,
    copy_pool_bytes,
    kivi_config,
    page_block_bytes,
    residual_dtype_name,
    sink_block_bytes,
)
from kvforge.integrations.vllm.kivi_pages import layer_bytes
from kvforge.integrations.vllm.kivi_stored import StoredForm

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
    """One page and its sink area plus its share of the exact copies (kivi_options.block_bytes_with_copies),
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
    page = page_block_bytes(config, kv_heads, head_dim) + sink_block_bytes(config, kv_heads, head_dim, element)
    return block_bytes_with_copies(page, pool, budget, max(1, len(layers)), config.key_tokens)


class KIVIMetadataBuilder(AttentionMetadataBuilder[KIVIMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = _config()
        if kv_cache_spec.block_size != self.config.key_tokens:
            raise ValueError(f"the KIVI backend needs block_size = key group = {self.config.key_tokens}, "
                             f"got {kv_cache_spec.block_size} (pass --block-size {self.config.key_tokens})")
        slots = exact_slots(self.config.key_tokens, self.config.residual, vllm_config.scheduler_config.max_num_seqs)
        self.copies = ExactCopies(slots, self.config.key_tokens, self.config.residual, self.config.sinks)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KIVIMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        return step_metadata(self.copies, cm.query_start_loc_cpu[:num_reqs + 1].tolist(),
                             cm.seq_lens.cpu()[:num_reqs].tolist(), cm.block_table_tensor[:num_reqs],
                             cm.num_actual_tokens)


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
        self._hf_config = vllm_config.model_config.hf_config.to_dict() if self.config.key_space == "pre_rope" else None
        self._storages: dict[int, KIVILayerStorage] = {}

    def _storage(self, kv_cache: torch.Tensor) -> KIVILayerStorage:
        """The layer's storage over its vLLM KV cache region (kivi_layer.py), made when the
        region is first seen."""
        storage = self._storages.get(kv_cache.data_ptr())
        if storage is None:
            kernel = resolve_decode_kernel(self.config.decode_kernel, kv_cache.device, self.config)
            form = StoredForm.of(self.config, self._hf_config, self.head_size, kv_cache.device)
            storage = KIVILayerStorage(self.config, self.num_kv_heads, self.head_size, self.residual_dtype,
                                       self.max_num_seqs, form, kernel)
            self._storages = {kv_cache.data_ptr(): storage}  # a new region replaces the old one
        storage.bind(layer_bytes(kv_cache, kv_cache.numel() * kv_cache.element_size()), kv_cache.shape[0])
        return storage

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        meta = _metadata_of(layer)
        if meta is None or kv_cache.numel() == 0:
            return
        n = meta.num_actual_tokens
        key, value = key[:n], value[:n]
        _STEP_KV[kv_cache.data_ptr()] = (key, value)
        self._storage(kv_cache).write(meta, key, value)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: KIVIMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        assert output is not None, "the KIVI backend writes into the layer's output buffer"
        if attn_metadata is None or kv_cache.numel() == 0:  # profiling run: no cache yet
            return output.fill_(0)
        if key is None or value is None:  # KV-sharing layer: its owner's exact K/V of this step
            key, value = _STEP_KV[kv_cache.data_ptr()]
        n = attn_metadata.num_actual_tokens
        output[:n] = self._storage(kv_cache).attend(attn_metadata, query, key, value, self.scale).to(output.dtype)
        return output


def _metadata_of(layer: AttentionLayer) -> KIVIMetadata | None:
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)  # type: ignore[attr-defined]
    return metadata if isinstance(metadata, KIVIMetadata) else None
