"""`kivi:key_dot=int8`: decode scores of quantised keys taken in the integer domain.

KIVI's keys are quantised per channel over a page of G tokens, k_hat(t, c) = code(t, c)
scale_c + zero_c, so a decode query's score splits as
    q . k_hat(t) = sum_c q_c zero_c + sum_c (q_c scale_c) code(t, c).
With key_dot=int8 the scaled query qsc = q * scale (per page and query head) is quantised
symmetrically to int8, q8_c = round(qsc_c * 127 / max_c |qsc_c|) (ties to even), and the
second sum is taken exactly over integers:
    score(t) = sum_c q_c zero_c + (max_c |qsc_c| / 127) * sum_c q8_c code(t, c).
This is llama.cpp's route for quantised K (q quantised to 8 bits against the packed codes):
on a CPU with VNNI one instruction multiplies-and-adds 4 codes per token for 16 tokens,
where the float path spends one FMA per code. What it costs in quality is measured, not
assumed (docs/cache-methods.md); `key_dot=float` (the default) is the paper's arithmetic.

Scope: decode queries over the quantised pages only. Keys still in the residual, sink
tokens, the step's own token and prefill chunks are scored exactly, as with key_dot=float.
It applies to keys stored post-RoPE with 2- or 4-bit codes (config.py validates that).

`int8_key_scores` is the PyTorch statement of the definition (the reference the C++
kernel is parity-tested against, bit for bit in the integer part).
"""

from __future__ import annotations

import torch

from kvforge.cache.kivi.quant import unpack_codes
from kvforge.cache.kivi.store import KIVILayerView

KEY_DOTS = ("float", "int8")
INT8_LEVELS = 127  # symmetric int8: q8 in [-127, 127]
# A row whose max |qsc| is below this counts as zero (q8 = 0): 127 / max would overflow to
# inf near float32's smallest normals, and inf * 0 is NaN. Far below any real score scale.
ZERO_ROW = 1e-30


def quantise_scaled_queries(qsc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qsc [..., D] float32 -> (q8 [..., D] as float32 integers, step [..., 1]) with
    qsc ~ q8 * step; a row below ZERO_ROW gets q8 = 0. 127 / max is one float32 division
    (not `127 / tensor`, which torch computes as a reciprocal times 127: two roundings), as
    the C++ kernel does, so both round each q8 from the same float."""
    top = qsc.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > ZERO_ROW, torch.full_like(top, INT8_LEVELS) / top, torch.zeros_like(top))
    return torch.round(qsc * inv), top / INT8_LEVELS


def int8_key_scores(qh: torch.Tensor, view: KIVILayerView, page_ids: torch.Tensor) -> torch.Tensor:
    """Scores of the queries qh [H, B, group, D] (already multiplied by the softmax scale)
    against the keys of pages page_ids [B, m] (per sequence, in token order) under
    key_dot=int8: float32 [H, B, group, m * G]."""
    heads, batch, group, dim = qh.shape
    pages = page_ids.shape[1]
    flat = page_ids.reshape(-1)
    codes = unpack_codes(view.k_codes.index_select(1, flat), view.bits).float()  # [H, B*m, D, G]
    codes = codes.view(heads, batch, pages, dim, -1)
    k_scale = view.k_scale.index_select(1, flat).float().view(heads, batch, pages, 1, dim)
    k_zero = view.k_zero.index_select(1, flat).float().view(heads, batch, pages, 1, dim)
    q = qh[:, :, None]  # [H, B, 1, group, D]
    q8, step = quantise_scaled_queries(q * k_scale)  # [H, B, m, group, D], [H, B, m, group, 1]
    zero_part = (q * k_zero).sum(dim=-1, keepdim=True)
    # Integers below 2^24 (|q8| <= 127, codes <= 15, D <= 8,192): float32 sums them exactly.
    integer_part = torch.einsum("hbmgd,hbmdt->hbmgt", q8, codes)
    scores = zero_part + step * integer_part  # [H, B, m, group, G]
    return scores.permute(0, 1, 3, 2, 4).reshape(heads, batch, group, -1)
