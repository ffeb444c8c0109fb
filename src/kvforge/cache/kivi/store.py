"""KIVI storage: quantised pages plus per-sequence full-precision residuals (layout in
/work/notes/kivi_layout.md, summarised here).

Pages (block_size = G tokens, G = key_group; one page id valid for every layer of a layer
group; Gv = value_group channels, G and Gv both `group` in the paper's setting):
  k_codes  uint8   [group_size, H, P, D, G*b/8]  keys per channel over the page's G tokens
  k_scale, k_zero  [group_size, H, P, D]          float16
  v_codes  uint8   [group_size, H, P, G, D*b/8]  values per token over groups of Gv channels
  v_scale, v_zero  [group_size, H, P, G, D/Gv]    float16
Residuals (residual_dtype): k_res, v_res [num_cache_layers, S, H, R, D]; token t of a
sequence sits at offset t % R of its slot in both.
Sinks (residual_dtype, `sinks` = N > 0 only): k_sink, v_sink [num_cache_layers, S, H, N, D],
token t < N of a sequence at index t of its slot; readers take those tokens from here, never
from the pages (whose codes for them exist but are not read).
Keys are stored in the configured key space (post- or pre-RoPE, possibly rotated), values
possibly rotated: this module does not know; the readers apply `KeyTransform`.

Invariants for a sequence holding n tokens (nk = (n // R) * R, nv = max(0, n - R)):
- keys of tokens [0, nk) are in k_codes, keys of [nk, n) in k_res;
- values of tokens [0, nv) are in v_codes, values of [nv, n) in v_res (a ring);
- quantisation reads the residual_dtype value of a token, so what is stored after n tokens
  does not depend on how the tokens were chunked into steps.
This module is the arithmetic on those tensors (quantise into pages, dequantise pages); the
cache method decides which tokens move when.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache.kivi.quant import PARAM_DTYPE, quantize, unpack_codes


@dataclass(frozen=True)
class KIVILayerView:
    """The tensors of one cache layer (views into the store, no copies). The writers below
    also take `KIVIStore.all_layers()`, the same tensors with a leading layer dimension."""

    k_codes: torch.Tensor  # [H, P, D, G*b/8]
    k_scale: torch.Tensor  # [H, P, D]
    k_zero: torch.Tensor  # [H, P, D]
    v_codes: torch.Tensor  # [H, P, G, D*b/8]
    v_scale: torch.Tensor  # [H, P, G, D/G]
    v_zero: torch.Tensor  # [H, P, G, D/G]
    k_res: torch.Tensor  # [S, H, R, D]
    v_res: torch.Tensor  # [S, H, R, D]
    bits: int  # of the key codes
    k_sink: torch.Tensor | None = None  # [S, H, N, D], None without sinks
    v_sink: torch.Tensor | None = None
    value_bits: int | None = None  # of the value codes; None: `bits`

    @property
    def vbits(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits

    @property
    def group(self) -> int:
        """Tokens per page (= key_group)."""
        return self.v_codes.shape[-2]

    @property
    def value_group(self) -> int:
        """Channels per value group."""
        return self.k_codes.shape[-2] // self.v_scale.shape[-1]

    @property
    def sinks(self) -> int:
        return 0 if self.k_sink is None else self.k_sink.shape[-2]

    @property
    def residual(self) -> int:
        return self.k_res.shape[-2]


def page_bytes(group_size: int, kv_heads: int, head_dim: int, bits: int, group: int,
               value_group: int | None = None, value_bits: int | None = None) -> int:
    """Bytes of one page: G tokens of K and V codes plus float16 scale/zero, every layer of a
    group (G = `group` tokens per key group, values in groups of `value_group` channels;
    `bits` per key code, `value_bits` (default `bits`) per value code)."""
    value_group = group if value_group is None else value_group
    value_bits = bits if value_bits is None else value_bits
    param = torch.tensor([], dtype=PARAM_DTYPE).element_size()
    codes = group * head_dim * (bits + value_bits) // 8  # K and V codes of G tokens, one head
    k_params = 2 * head_dim * param  # one scale and zero per channel per page
    v_params = 2 * group * (head_dim // value_group) * param  # per token per channel group
    return group_size * kv_heads * (codes + k_params + v_params)


class KIVIStore:
    """All KIVI tensors of one cache, allocated with torch.empty (untouched memory costs no RAM)."""

    def __init__(self, group_size: int, num_cache_layers: int, kv_heads: int, head_dim: int, num_pages: int,
                 num_slots: int, bits: int, group: int, residual: int, residual_dtype: torch.dtype,
                 device: torch.device, value_group: int | None = None, sinks: int = 0,
                 value_bits: int | None = None) -> None:
        self.bits, self.group, self.residual = bits, group, residual
        self.value_bits = bits if value_bits is None else value_bits
        value_group = group if value_group is None else value_group
        h, d, g, p = kv_heads, head_dim, group, num_pages
        empty = lambda *shape, dtype: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
        self.k_codes = empty(group_size, h, p, d, g * bits // 8, dtype=torch.uint8)
        self.k_scale = empty(group_size, h, p, d, dtype=PARAM_DTYPE)
        self.k_zero = empty(group_size, h, p, d, dtype=PARAM_DTYPE)
        self.v_codes = empty(group_size, h, p, g, d * self.value_bits // 8, dtype=torch.uint8)
        self.v_scale = empty(group_size, h, p, g, d // value_group, dtype=PARAM_DTYPE)
        self.v_zero = empty(group_size, h, p, g, d // value_group, dtype=PARAM_DTYPE)
        self.k_res = empty(num_cache_layers, num_slots, h, residual, d, dtype=residual_dtype)
        self.v_res = empty(num_cache_layers, num_slots, h, residual, d, dtype=residual_dtype)
        self.k_sink = empty(num_cache_layers, num_slots, h, sinks, d, dtype=residual_dtype) if sinks else None
        self.v_sink = empty(num_cache_layers, num_slots, h, sinks, d, dtype=residual_dtype) if sinks else None
        # layer() views, built once: the storage tensors above are never replaced, and a
        # decode step asks for every layer's view (about ten selects each, every step;
        # docs/benchmarks.md#measurements-behind-design-choices).
        self._layer_views: dict[tuple[int, int], KIVILayerView] = {}

    def all_layers(self) -> KIVILayerView:
        """Every layer at once: pages [group_size, ...] (slot index within a layer group),
        residuals [num_cache_layers, ...]; for the writers, which then quantise a layer group's
        flushed tokens in one call."""
        return KIVILayerView(self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                             self.k_res, self.v_res, self.bits, self.k_sink, self.v_sink, self.value_bits)

    def layer(self, index: int, cache_layer: int) -> KIVILayerView:
        """`index`: the layer's slot within its layer group (pages); `cache_layer`: residuals."""
        view = self._layer_views.get((index, cache_layer))
        if view is None:
            view = self._layer_views[index, cache_layer] = self._make_layer(index, cache_layer)
        return view

    def _make_layer(self, index: int, cache_layer: int) -> KIVILayerView:
        sinks = (None, None) if self.k_sink is None or self.v_sink is None \
            else (self.k_sink[cache_layer], self.v_sink[cache_layer])
        return KIVILayerView(self.k_codes[index], self.k_scale[index], self.k_zero[index], self.v_codes[index],
                             self.v_scale[index], self.v_zero[index], self.k_res[cache_layer],
                             self.v_res[cache_layer], self.bits, *sinks, self.value_bits)


# -- writing --------------------------------------------------------------------------
# Both writers take a layer view, or `KIVIStore.all_layers()` with sources carrying the same
# leading dimension as its pages (one entry per slot index of a layer group).
def store_key_pages(view: KIVILayerView, keys: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Quantise keys [*lead, n_pages * G, H, D] (tokens of whole pages, in order) per channel
    over each page's G tokens and write them to `page_ids` [n_pages]."""
    heads, dim, g = keys.shape[-2], keys.shape[-1], view.group
    lead = keys.shape[:-3]
    # [*lead, H, n_pages, D, G]: the token axis of each page last, the one `quantize` groups.
    per_channel = keys.reshape(*lead, -1, g, heads, dim).movedim(-2, -4).transpose(-1, -2)
    q = quantize(per_channel, view.bits, g)
    view.k_codes.index_copy_(-3, page_ids, q.packed)
    view.k_scale.index_copy_(-2, page_ids, q.scale.squeeze(-1))
    view.k_zero.index_copy_(-2, page_ids, q.zero.squeeze(-1))


def store_value_tokens(view: KIVILayerView, values: torch.Tensor, flat_slots: torch.Tensor) -> None:
    """Quantise values [*lead, n, H, D] per token over groups of Gv channels and write token i
    to the page slot flat_slots[i] = page * G + offset."""
    heads, dim, g, gv = values.shape[-2], values.shape[-1], view.group, view.value_group
    lead = values.shape[:-3]
    q = quantize(values.transpose(-3, -2), view.vbits, gv)  # [*lead, H, n, ...]
    pages = view.v_codes.shape[-3]
    view.v_codes.view(*lead, heads, pages * g, -1).index_copy_(-2, flat_slots, q.packed)
    view.v_scale.view(*lead, heads, pages * g, dim // gv).index_copy_(-2, flat_slots, q.scale)
    view.v_zero.view(*lead, heads, pages * g, dim // gv).index_copy_(-2, flat_slots, q.zero)


# -- reading --------------------------------------------------------------------------
def dequantize_key_pages(view: KIVILayerView, page_ids: torch.Tensor) -> torch.Tensor:
    """Keys of `page_ids` [n] as float32 [H, n * G, D] (tokens in page order)."""
    codes = unpack_codes(view.k_codes.index_select(1, page_ids), view.bits).float()  # [H, n, D, G]
    keys = codes * view.k_scale.index_select(1, page_ids).float()[..., None] \
        + view.k_zero.index_select(1, page_ids).float()[..., None]
    heads, n, dim, g = keys.shape
    return keys.transpose(2, 3).reshape(heads, n * g, dim)


def dequantize_value_pages(view: KIVILayerView, page_ids: torch.Tensor) -> torch.Tensor:
    """Values of `page_ids` [n] as float32 [H, n * G, D] (slots never written are garbage)."""
    codes = unpack_codes(view.v_codes.index_select(1, page_ids), view.vbits).float()  # [H, n, G, D]
    heads, n, g, dim = codes.shape
    gv = view.value_group
    grouped = codes.view(heads, n, g, dim // gv, gv)
    values = grouped * view.v_scale.index_select(1, page_ids).float()[..., None] \
        + view.v_zero.index_select(1, page_ids).float()[..., None]
    return values.reshape(heads, n * g, dim)
