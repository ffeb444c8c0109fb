"""The tensors of the vLLM KIVI backend: kvforge's KIVI pages laid over one layer's vLLM KV
cache bytes, and the pool of exact block copies (torch; no vLLM import).

vLLM hands each layer one contiguous region of `num_blocks * page_block_bytes` bytes
(layer-outermost layout). It is cut component-major, so each component is the contiguous
tensor kvforge's KIVI store has and its kernels read in place (block id = page id):

    k_codes uint8 [H, P, D, G*kb/8] | k_scale, k_zero fp16 [H, P, D] |
    v_codes uint8 [H, P, G, D*vb/8] | v_scale, v_zero fp16 [H, P, G, D/Gv]

(P = num_blocks, G = key_tokens = vLLM block size, Gv = value channels per group). With
sinks (N > 0) the pages are followed by the sink area, k_sink, v_sink [P, N, H, D] in the
residual dtype (`SinkArea`: block p's area holds the first N tokens of a sequence whose
first block is p), then by the exact copies (`ExactPool`). vLLM itself never reads these bytes; it only zeroes new blocks for mixed-precision or Mamba
caches, neither of which this backend allows.
"""

from __future__ import annotations

import torch

from kvforge.cache.kivi.config import KIVICacheConfig
from kvforge.cache.kivi.quant import PARAM_DTYPE
from kvforge.cache.kivi.store import KIVILayerView


def _component_shapes(config: KIVICacheConfig, num_blocks: int, kv_heads: int,
                      head_dim: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    h, p, d, g, gv = kv_heads, num_blocks, head_dim, config.key_tokens, config.value_channels
    return [("k_codes", (h, p, d, g * config.kbits // 8), torch.uint8),
            ("k_scale", (h, p, d), PARAM_DTYPE), ("k_zero", (h, p, d), PARAM_DTYPE),
            ("v_codes", (h, p, g, d * config.vbits // 8), torch.uint8),
            ("v_scale", (h, p, g, d // gv), PARAM_DTYPE), ("v_zero", (h, p, g, d // gv), PARAM_DTYPE)]


def region_bytes(config: KIVICacheConfig, num_blocks: int, kv_heads: int, head_dim: int) -> int:
    """Bytes the components take: num_blocks pages (equals num_blocks * page_block_bytes)."""
    total = 0
    for _, shape, dtype in _component_shapes(config, num_blocks, kv_heads, head_dim):
        total += torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    return total


def page_components(region: torch.Tensor, config: KIVICacheConfig, num_blocks: int, kv_heads: int,
                    head_dim: int) -> dict[str, torch.Tensor]:
    """Views of the uint8 `region` [num_blocks * page bytes] as kvforge's page tensors."""
    need = region_bytes(config, num_blocks, kv_heads, head_dim)
    if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() != need or not region.is_contiguous():
        raise ValueError(f"the KV cache region must be {need} contiguous bytes (uint8), got "
                         f"{region.dtype} {tuple(region.shape)}")
    parts: dict[str, torch.Tensor] = {}
    start = 0
    for name, shape, dtype in _component_shapes(config, num_blocks, kv_heads, head_dim):
        size = torch.tensor([], dtype=dtype).element_size()
        count = torch.Size(shape).numel()
        if start % size:
            raise ValueError(f"{name} would start at byte {start}, not aligned to {size}")
        parts[name] = region[start:start + count * size].view(dtype).view(shape)
        start += count * size
    return parts


def layer_bytes(kv_cache: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """The `num_bytes` bytes a layer's vLLM cache view starts at, as one flat uint8 tensor
    over the same storage (the view must be contiguous: a layer-outermost layout)."""
    if not kv_cache.is_contiguous() or kv_cache.numel() * kv_cache.element_size() != num_bytes:
        raise ValueError(f"expected one contiguous KV cache region of {num_bytes} bytes per layer, got "
                         f"shape {tuple(kv_cache.shape)} {kv_cache.dtype} strides {kv_cache.stride()}")
    return kv_cache.reshape(-1).view(torch.uint8)


def typed_view(storage: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """`shape` elements of `dtype` over the first bytes of `storage` (uint8, aligned to the
    element size); `what` names the tenant in the error."""
    size = torch.tensor([], dtype=dtype).element_size()
    need = torch.Size(shape).numel() * size
    if storage.dtype != torch.uint8 or storage.numel() < need or storage.data_ptr() % size:
        raise ValueError(f"{what}: {need} bytes aligned to {size} needed, got "
                         f"{storage.numel()} {storage.dtype} at offset {storage.data_ptr() % size}")
    return storage[:need].view(dtype).view(shape)


class ExactPool:
    """Exact copies of `num_slots` blocks for one layer: keys and values [S, G, H, D] in the
    residual dtype (token-major, so a step's rows are written with one indexed copy). With
    `storage` (uint8 bytes, e.g. the spare bytes after a layer's pages in vLLM's KV cache
    region) the copies are views over its first `pool_bytes` bytes; else they are allocated."""

    def __init__(self, num_slots: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, storage: torch.Tensor | None = None) -> None:
        shape = (2, num_slots, block_size, kv_heads, head_dim)
        if storage is None:
            both = torch.empty(shape, dtype=dtype, device=device)
        else:
            both = typed_view(storage, shape, dtype, "the exact copies")
        # zeros: ring positions nobody reads still go through the kernels' arithmetic
        both.zero_()
        self.keys, self.values = both[0], both[1]

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def write(self, slots: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Token i of keys/values [n, H, D] to (slots[i], offsets[i])."""
        self.keys[slots, offsets] = keys.to(self.keys.dtype)
        self.values[slots, offsets] = values.to(self.values.dtype)

    def gather(self, sources: torch.Tensor, rows_k: torch.Tensor, rows_v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens at `sources` (flat copy index, or num_slots * G + row for the step's rows
        rows_k/rows_v [T, H, D], already in the residual dtype) as [len(sources), H, D]."""
        flat_k = self.keys.flatten(0, 1)
        flat_v = self.values.flatten(0, 1)
        pool = flat_k.shape[0]
        from_pool = sources < pool
        in_pool = sources.clamp(max=pool - 1)
        in_rows = (sources - pool).clamp(min=0, max=max(rows_k.shape[0] - 1, 0))
        if rows_k.shape[0] == 0:
            return flat_k[in_pool], flat_v[in_pool]
        mask = from_pool[:, None, None]
        return (torch.where(mask, flat_k[in_pool], rows_k[in_rows]),
                torch.where(mask, flat_v[in_pool], rows_v[in_rows]))


class SinkArea:
    """The exact first N tokens of sequences, per block: keys and values [P, N, H, D] in the
    residual dtype over `storage` (uint8 bytes after a layer's pages); only a sequence's
    first block's area is written and read (kivi_exact.py)."""

    def __init__(self, num_blocks: int, sinks: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 storage: torch.Tensor) -> None:
        both = typed_view(storage, (2, num_blocks, sinks, kv_heads, head_dim), dtype, "the sink area")
        self.keys, self.values = both[0], both[1]

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def write(self, blocks: torch.Tensor, tokens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Token tokens[i] < N of keys/values [n, H, D] to the area of block blocks[i]."""
        self.keys[blocks, tokens] = keys.to(self.keys.dtype)
        self.values[blocks, tokens] = values.to(self.values.dtype)

    def of(self, first_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sinks of the sequences whose first blocks are `first_blocks` [B], as kvforge's
        per-slot sink buffers [B, H, N, D] (slot i = sequence i)."""
        return (self.keys.index_select(0, first_blocks).transpose(1, 2).contiguous(),
                self.values.index_select(0, first_blocks).transpose(1, 2).contiguous())


def layer_view(parts: dict[str, torch.Tensor], config: KIVICacheConfig, ring_keys: torch.Tensor,
               ring_values: torch.Tensor, sinks: tuple[torch.Tensor, torch.Tensor] | None = None) -> KIVILayerView:
    """kvforge's KIVILayerView over the pages, with rings [B, H, R, D] and, with sinks, sink
    buffers [B, H, N, D] (slot i = sequence i)."""
    k_sink, v_sink = sinks if sinks is not None else (None, None)
    return KIVILayerView(parts["k_codes"], parts["k_scale"], parts["k_zero"], parts["v_codes"], parts["v_scale"],
                         parts["v_zero"], ring_keys, ring_values, config.kbits, k_sink, v_sink, config.vbits)
