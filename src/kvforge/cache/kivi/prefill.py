"""Fast attention of one prefill chunk over KIVI storage, matching `kivi_chunk_attention`.

The chunk's queries see three parts, each attended separately and merged by log-sum-exp:
1. the chunk's own exact K/V, causally, through one fused attention
   (kernels/cpu_causal_attention for bf16 and float32 on the CPU, as the full cache does;
   else ATen's flash kernel in float32);
2. the stored quantised pages, tile by tile: a tile of `tile_pages` pages is dequantised
   into float32 (its values from the residual ring for tokens in [nv, nk)) and attended by
   every query row at once, so the dequantisation is paid once per tile, not once per row,
   and the attention is a matrix product over all rows;
3. the key residual's tokens [max(nk, past_from), n) (keys and values from the residuals).
Stored tokens all precede the chunk, so parts 2 and 3 need no causal mask: without a
sliding window or a partly released first page they are attended with no mask at all. The
query heads of a kv head are folded into rows ([H, group * L, D]), so grouped-query
attention needs no copy of the dequantised K/V.

bf16 on the CPU, where every row sees every stored token (no sliding window, nothing
released) and at most MAX_PAST_IN_ONE_CALL tokens are stored, parts 1-3 are one call of the
causal kernel instead, over the stored tokens rounded to bf16 followed by the chunk's own
(`_past_and_own_in_one_call`). Otherwise no sequence's cache is ever dequantised whole: at
most one tile plus the residual.

`attention_with_lse` uses ATen's CPU flash-attention operator, which returns the
log-sum-exp beside the output; elsewhere (other devices or dtypes) a plain float32 path
computes the same. Both are float32 throughout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvforge.cache.attention import _FLASH_CPU, visibility_mask
from kvforge.cache.kivi.attention import stored_parts
from kvforge.cache.kivi.key_space import KeyTransform
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.cache.softmax_merge import LseMerge
from kvforge.kernels.cpu_causal_attention import causal_attention_available
from kvforge.kernels.prefill_attention import causal_attention


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
                       visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp, float32.

    q [h, n, D], k/v [h, m, D] (same heads); `causal` (n == m, query i sees keys <= i) or a
    bool mask `visible` [n, m] shared by the heads, or neither. Returns out [h, n, D] and
    lse [h, n]; a row that sees no key gets out 0 and lse -inf (a neutral element of the merge).
    Keys hidden from every row must hold finite numbers (callers zero unwritten storage)."""
    q, k, v = q.float(), k.float(), v.float()
    if _FLASH_CPU is not None and q.device.type == "cpu":
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
            mask.masked_fill_(~visible, float("-inf"))
        # The operator misreads inputs whose last dimension is strided (seen with torch 2.13,
        # e.g. the keys of a single dequantised page): hand it contiguous tensors.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _FLASH_CPU(q[None], k[None], v[None], 0.0, causal, attn_mask=mask, scale=scale)
        out, lse = out[0], lse[0]
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        out = torch.matmul(torch.exp(scores - finite[..., None]), v)
    if visible is not None and not causal:
        # The fused operator answers out 0, lse 0 for a row with no visible key; make it -inf.
        seen = visible.any(dim=-1)
        if not bool(seen.all()):
            lse = lse.masked_fill(~seen, float("-inf"))
            out = out.masked_fill(~seen[:, None], 0.0)
    return out, lse


# Stored tokens up to which a bf16 chunk attends them and its own K/V in one causal-kernel
# call: their bf16 copy is 4 * H * D bytes a token (3 MiB a layer at 4,096 tokens on
# smollm2-135m); longer pasts keep the tile walk, which never holds more than a tile.
MAX_PAST_IN_ONE_CALL = 32768


def _past_and_own_in_one_call(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, past_len: int,
                              scale: float, parts: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                              ) -> torch.Tensor | None:
    """A later chunk of a bf16 prompt whose rows all see every stored token (no window, none
    released): the stored tokens (`parts`, a lazy `stored_parts` walk: nothing is dequantised
    unless the kernel applies; dequantised in float32, then rounded to bf16)
    followed by the chunk's own K/V, through kernels/cpu_causal_attention in one call (the
    chunk's queries are the last L of the past_len + L keys). Returns out [L, heads, D] or
    None where the kernel does not apply (not bf16, too long a past, autograd, no kernel).

    Precision: the stored keys and values are rounded to bf16 before the dot products, as
    the full cache's bf16 pages are; the float32 tile walk keeps them in float32. Speed: on
    a long bf16 prompt this made KIVI's attention much faster than the walk (ATen's float32
    attention per tile), close to the full cache's (docs/benchmarks.md, 'Measurements
    behind design choices')."""
    if (q.dtype != torch.bfloat16 or not q.is_cpu or past_len > MAX_PAST_IN_ONE_CALL
            or (torch.is_grad_enabled() and q.requires_grad) or not causal_attention_available()):
        return None
    keys, values = [], []
    for _, k, v in parts:
        keys.append(k.to(torch.bfloat16))
        values.append(v.to(torch.bfloat16))
    keys.append(k_new.transpose(0, 1))
    values.append(v_new.transpose(0, 1))
    result = causal_attention(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), scale)
    return None if result is None else result[0]


def kivi_chunk_attention_fast(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, view: KIVILayerView,
                              pages: torch.Tensor, first_page_position: int, past_from: int, cached_len: int,
                              slot: int, scale: float, window: int | None, tile_pages: int,
                              key_transform: KeyTransform = None) -> torch.Tensor:
    """Arguments and result as `attention.kivi_chunk_attention`: queries q [L, heads, D]
    at positions [cached_len, cached_len + L) over their own exact k_new/v_new [L, H, D] and
    the stored tokens [past_from, cached_len) of one sequence; `pages` [m] holds tokens
    [first_page_position, nk) in order."""
    length, heads, dim = q.shape
    kv_heads = k_new.shape[1]
    group = heads // kv_heads
    q_pos = torch.arange(cached_len, cached_len + length, device=q.device)

    if window is None and past_from < cached_len and past_from <= first_page_position:
        # Every stored token is visible to every row: bf16 on the CPU takes one kernel call.
        whole = _past_and_own_in_one_call(q, k_new, v_new, cached_len - first_page_position, scale,
                                          stored_parts(view, pages, first_page_position, past_from, cached_len,
                                                       slot, tile_pages, key_transform))
        if whole is not None:
            return whole

    # 1. Own chunk: heads-major [heads, L, D]. bf16 or float32 on the CPU: the causal
    # kernel, which reads grouped K/V in place (its precision is the full cache's prefill);
    # else float32 with GQA by expanding the chunk's K/V (small).
    own = None
    if window is None or window >= length:
        own = causal_attention(q, k_new.transpose(0, 1), v_new.transpose(0, 1), scale)
    if own is not None and cached_len <= past_from:
        # Nothing stored is visible (a prompt's first chunk): the kernel's output [L, heads,
        # D] in q's dtype is the answer. The merge below would widen it to float32 and round
        # it back (exact), through ~5 chunk-sized float32 temporaries a layer; at 2,048
        # tokens they were mostly freshly mapped memory, whose page faults made KIVI's attend
        # markedly slower (docs/benchmarks.md, 'Measurements behind design choices').
        return own[0]
    qh = q.float().transpose(0, 1)
    if own is not None:
        out, lse = own[0].float().transpose(0, 1).contiguous(), own[1]
    else:
        own_k = k_new.float().transpose(0, 1).repeat_interleave(group, dim=0)
        own_v = v_new.float().transpose(0, 1).repeat_interleave(group, dim=0)
        if window is None or window >= length:
            out, lse = attention_with_lse(qh, own_k, own_v, scale, causal=True)
        else:
            out, lse = attention_with_lse(qh, own_k, own_v, scale, visible=visibility_mask(q_pos, q_pos, window))
    # Fold the query heads of each kv head into rows: [heads, L, D] -> [H, group * L, D]
    # (row j * L + i is query head h * group + j at position n + i).
    merge = LseMerge(out.reshape(kv_heads, group * length, dim), lse.reshape(kv_heads, group * length))
    rows = qh.reshape(kv_heads, group * length, dim)
    row_pos = q_pos.repeat(group)

    def attend(k_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stored tokens at positions k_pos [m] (all before the chunk); keys/values [H, m, D]."""
        visible = None
        if window is not None or int(k_pos[0]) < past_from:
            visible = visibility_mask(row_pos, k_pos, window) & (k_pos >= past_from)[None, :]
            used = visible.any(dim=0)
            if not bool(used.any()):
                return
            if not bool(used.all()):  # unread slots may hold NaN bits: zero them
                keys = keys.masked_fill(~used[None, :, None], 0.0)
                values = values.masked_fill(~used[None, :, None], 0.0)
            if bool(visible.all()):
                visible = None
        merge.add(*attention_with_lse(rows, keys, values, scale, visible=visible))

    # 2. What the sequence stores: quantised pages a tile at a time, then the key residual.
    for k_pos, keys, values in stored_parts(view, pages, first_page_position, past_from, cached_len, slot,
                                            tile_pages, key_transform):
        attend(k_pos, keys, values)
    out = merge.out.view(kv_heads, group, length, dim).permute(2, 0, 1, 3)
    return out.reshape(length, heads, dim).to(q.dtype)
