"""Decode attention over the paged KIVI store, in plain PyTorch: the reference of the kernels.

One query token per sequence attends to its own exact key/value plus the stored tokens
[visible_from, n) of its sequence, one page (`group` tokens) at a time with an online
softmax, so no sequence's cache is dequantised whole. Each page is dequantised with
`quant.dequantize` itself, so the arithmetic is the quantiser's by construction.

Arguments (the KIVI storage layout, for one cache layer, i.e. already indexed by its slot):
- q [B, heads, D]; k_self, v_self [B, kv_heads, D]: the step's own token, always visible.
- k_codes uint8 [kv_heads, P, D, group*bits/8] (keys per channel over a page's tokens),
  k_scale/k_zero fp16 [kv_heads, P, D]; v_codes uint8 [kv_heads, P, group, D*bits/8]
  (values per token over groups of `group` channels), v_scale/v_zero fp16
  [kv_heads, P, group, D/group]. Views such as `store[index]` are fine.
- k_residual, v_residual [S, kv_heads, R, D]: residual ring buffers (the store of one
  cache layer); sequence b owns slot slots[b], and its token t sits at row t % R. Keys
  [nk, n) and values [nv, n) must each span at most R tokens (the KIVI rules guarantee
  it); other rows are never used and may hold anything.
- page_table [B, W], first_page_position [B] (a multiple of `group`): column j holds the
  page of tokens [first_page_position + j*group, first_page_position + (j+1)*group).
  Entries and columns whose page holds no visible quantised token (released pages of a
  sliding window, padding, pages past nk) are never used and may be -1 or absent.
- nk, nv, visible_from, n [B]: keys of tokens < nk and values of tokens < nv come from the
  pages, the others from the residuals; tokens [visible_from, n) are visible.
`bits`: of the key codes; `value_bits`: of the value codes (None: `bits`).
Returns [B, heads, D] in q's dtype; query head h reads kv head h // (heads // kv_heads).
"""

from __future__ import annotations

import math

import torch

from kvforge.cache.kivi.quant import QuantizedGroups, dequantize
from kvforge.cache.softmax_merge import OnlineSoftmax


def kivi_decode_attention_reference(
        q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
        k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
        v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
        k_residual: torch.Tensor, v_residual: torch.Tensor, slots: torch.Tensor,
        page_table: torch.Tensor, first_page_position: torch.Tensor,
        nk: torch.Tensor, nv: torch.Tensor, visible_from: torch.Tensor, n: torch.Tensor,
        scale: float, bits: int, group: int, value_bits: int | None = None) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_self.shape[1]
    qh = (q.float() * scale).view(batch, kv_heads, heads // kv_heads, dim)
    # The step's own key seeds the running max and sum, so every row stays finite even
    # when a page has no visible token.
    state = OnlineSoftmax.one_key(torch.einsum("bhgd,bhd->bhg", qh, k_self.float())[..., None],
                                  v_self.float()[:, :, None, :])
    nk, nv, visible_from, n, first_page_position = (
        t.to(q.device, torch.long)[:, None] for t in (nk, nv, visible_from, n, first_page_position))
    slots = slots.to(q.device, torch.long)
    k_ring, v_ring = k_residual.index_select(0, slots), v_residual.index_select(0, slots)  # R tokens each
    offsets = torch.arange(group, device=q.device)
    width = page_table.shape[1]
    first_page = int(visible_from.min()) // group if batch else 0
    end_page = math.ceil(int(n.max()) / group) if batch else 0
    for page in range(first_page, end_page):
        positions = page * group + offsets[None, :]  # [1, group]
        visible = (positions >= visible_from) & (positions < n)  # [B, group]
        # Pages no sequence reads here (released, padding, outside the table) are
        # dequantised from page 0 and discarded by the selections below.
        columns = (page - first_page_position // group).clamp(0, max(width - 1, 0))
        ids = page_table.long().gather(1, columns)[:, 0].clamp(min=0) if width else columns[:, 0] * 0
        k_page = dequantize(QuantizedGroups(k_codes[:, ids], k_scale[:, ids, :, None], k_zero[:, ids, :, None],
                                            bits, group))  # [H, B, D, group]
        v_page = dequantize(QuantizedGroups(v_codes[:, ids], v_scale[:, ids], v_zero[:, ids],
                                            bits if value_bits is None else value_bits, group))
        k = torch.where((positions < nk)[:, None, :, None], k_page.permute(1, 0, 3, 2),
                        _residual_rows(k_ring, positions))
        v = torch.where((positions < nv)[:, None, :, None], v_page.transpose(0, 1),
                        _residual_rows(v_ring, positions))
        # Unused slots may hold NaN/inf bits: mask scores with -inf and zero the values,
        # since 0 * NaN would poison the sum.
        v = v.masked_fill(~visible[:, None, :, None], 0.0)
        scores = torch.einsum("bhgd,bhtd->bhgt", qh, k).masked_fill(~visible[:, None, None, :], float("-inf"))
        state.add(scores, v, weigh=lambda probs, v=v: torch.einsum("bhgt,bhtd->bhgd", probs, v))
    return state.result().reshape(batch, heads, dim).to(q.dtype)


def _residual_rows(ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ring [B, H, R, D], positions [1, T] -> float32 [B, H, T, D]: row position % R."""
    index = (positions % ring.shape[2])[:, None, :, None]
    return torch.take_along_dim(ring, index, dim=2).float()
