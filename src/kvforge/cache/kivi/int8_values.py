"""`kivi:value_dot=int8`: the decode output's sum over quantised values taken in the integer domain.

KIVI's values are quantised per token over groups of GV channels, v_hat(t, c) =
code(t, c) sigma(t, g) + zeta(t, g) for channel c in group g, so with softmax weights p_t
the output over a page's quantised tokens splits as
    sum_t p_t v_hat(t, c) = sum_t w(t, g) code(t, c) + sum_t p_t zeta(t, g),
    w(t, g) = p_t sigma(t, g)  (>= 0).
With value_dot=int8 the weights are quantised per (page, query head, channel group) to
unsigned 8 bits, w8 = round(w * 255 / max_t w) (ties to even; 0 for tokens not read from
the page), and the first sum is taken exactly over integers:
    (max_t w / 255) * sum_t w8(t, g) code(t, c)  +  sum_t p_t zeta(t, g)  (exact floats).
The weights' common factor (the softmax's reference max) cancels in w8 in exact
arithmetic, so w8 depends only on the page's scores and scales; in floats each path's own
probabilities may put a near-tie weight on the other side of a rounding boundary. With VNNI one instruction multiplies-and-adds 4
tokens' codes for 16 channels where the float path dequantises every code and spends one
FMA per code and head. Unsigned weights (p and sigma are never negative) give 255 levels
rather than int8's 127. What it costs in quality is measured, not assumed
(docs/cache-methods.md); `value_dot=float` (the default) is the paper's arithmetic.

Scope: decode queries over the quantised pages' values (tokens t < nv that are not sinks).
Values still in the residual ring, sink tokens, the step's own token and prefill chunks
stay exact. It applies to 2- or 4-bit value codes (config.py validates that).

`int8_value_sums` is the PyTorch statement of the definition (the reference the C++
kernel is tested against).
"""

from __future__ import annotations

import torch

from kvforge.cache.kivi.int8_keys import ZERO_ROW
from kvforge.cache.kivi.quant import unpack_codes
from kvforge.cache.kivi.store import KIVILayerView

VALUE_DOTS = ("float", "int8")
WEIGHT_LEVELS = 255  # unsigned 8-bit weights: w8 in [0, 255]


def quantise_weights(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w >= 0 float32 -> (w8 as float32 integers in [0, 255], step) with w ~ w8 * step, each
    slice along `dim` scaled by its own max (kept as a size-1 dim in step); a slice whose max
    is below ZERO_ROW gets w8 = 0. 255 / max is one float32 division, as in the C++ kernel."""
    top = w.amax(dim=dim, keepdim=True)
    inv = torch.where(top > ZERO_ROW, torch.full_like(top, WEIGHT_LEVELS) / top, torch.zeros_like(top))
    return torch.round(w * inv), top / WEIGHT_LEVELS


def int8_value_sums(probs: torch.Tensor, view: KIVILayerView, page_ids: torch.Tensor,
                    quantised: torch.Tensor) -> torch.Tensor:
    """sum_t probs_t v_hat(t) over the tokens of pages page_ids [B, m] (per sequence, in token
    order) marked `quantised` [B, m * G], under value_dot=int8: probs [H, B, group, m * G]
    (>= 0) -> float32 [H, B, group, D]."""
    heads, batch, group, tokens = probs.shape
    pages = page_ids.shape[1]
    flat = page_ids.reshape(-1)
    codes = unpack_codes(view.v_codes.index_select(1, flat), view.vbits).float()  # [H, B*m, G, D]
    g, dim = codes.shape[-2], codes.shape[-1]
    groups = view.v_scale.shape[-1]
    codes = codes.view(heads, batch, pages, g, groups, dim // groups)
    scale = view.v_scale.index_select(1, flat).float().view(heads, batch, 1, pages, g, groups)
    zero = view.v_zero.index_select(1, flat).float().view(heads, batch, 1, pages, g, groups)
    p = probs.view(heads, batch, group, pages, g, 1)
    # where, not a product with the mask: pages never written may hold NaN scales and zeros.
    read = quantised.view(1, batch, 1, pages, g, 1)
    w8, step = quantise_weights(torch.where(read, p * scale, 0.0), dim=-2)  # [H, B, group, m, G, groups]
    # Integers below 2^24 (w8 <= 255, codes <= 15, G <= 4,096): float32 sums them exactly.
    integer_part = torch.einsum("hbqmts,hbmtsc->hbqmsc", w8, codes)  # [H, B, group, m, groups, GV]
    zero_part = torch.where(read, p * zero, 0.0).sum(dim=-2)  # [H, B, group, m, groups]
    per_page = step.squeeze(-2)[..., None] * integer_part + zero_part[..., None]
    return per_page.sum(dim=3).reshape(heads, batch, group, dim)
