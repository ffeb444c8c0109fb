"""Attention kernels in plain PyTorch, shared by cache methods.

- `reference_attention`: the definition (explicit mask, float32 softmax). Tests compare
  every other path against it.
- `chunk_attention`: a span of queries over a dense key range (prefill chunks), through
  `scaled_dot_product_attention`, or for bf16 and float32 on the CPU the causal kernel of
  `kernels/cpu_causal_attention` (faster than ATen's: docs/benchmarks.md, 'Measurements
  behind design choices').
- `decode_attention`: one query per sequence for a batch of sequences, reading paged
  storage tile by tile with an online softmax, so no sequence's cache is copied whole.
- `gathered_decode_attention`: the same result from one gather of every page and one
  `scaled_dot_product_attention` call: a few large operations instead of a dozen per tile,
  which is what a GPU needs (each operation there is a kernel launch). It copies the batch's
  tables, padded to the widest, about three times per layer (gather, mask, own token), and
  works in q's dtype (the tiled path in float32); the `full` cache bounds the copy
  (`decode_gather_max_bytes`).

Shapes: queries [n, heads, head_dim]; keys/values [m, kv_heads, head_dim]; grouped-query
attention maps query head h to kv head h // (heads // kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.cache.softmax_merge import LseMerge, OnlineSoftmax
from kvforge.kernels.prefill_attention import causal_attention

# ATen's CPU flash attention, which returns the log-sum-exp beside the output (float32).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def visibility_mask(q_positions: torch.Tensor, k_positions: torch.Tensor,
                    window: int | None) -> torch.Tensor:
    """[n, m] bool: query at p sees key at s iff s <= p and (no window or s > p - window)."""
    delta = q_positions[:, None] - k_positions[None, :]
    visible = delta >= 0
    if window is not None:
        visible &= delta < window
    return visible


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                        k_positions: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    scores = scores.masked_fill(~visibility_mask(q_positions, k_positions, window)[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, vf).to(q.dtype)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_q_position: int,
                    first_k_position: int, scale: float, window: int | None) -> torch.Tensor:
    """Queries [n, heads, D] at consecutive positions over head-major keys/values
    [kv_heads, m, D] at consecutive positions.

    With a sliding window shorter than the key range, queries go in tiles that each see
    only the keys their window can reach: the work is n x (tile + window) instead of
    n x m (a 32K gemma3 prompt spent most of its prefill on masked-out keys of its
    sliding-window layers). Every tile's softmax runs over exactly the keys the query
    can see, so the result is the untiled one up to summation order.
    """
    n, m = q.shape[0], k.shape[1]
    group = q.shape[1] // k.shape[0]
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    trailing = first_q_position == first_k_position + m - n  # queries = the last n keys (n == m: all)
    if trailing and (window is None or window >= m):
        fast = causal_attention(q, k, v, scale)  # bf16/float32 on the CPU, grouped K/V read in place
        if fast is not None:
            return fast[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    if window is not None and m > window + _window_tile(window):
        return torch.cat([_masked_attention(q[start:start + tile], k[:, lo:hi], v[:, lo:hi],
                                            first_q_position + start, first_k_position + lo, scale, window)
                          for start, tile, lo, hi in _window_tiles(n, m, first_q_position, first_k_position,
                                                                   window)])
    qh = q.transpose(0, 1)[None]
    aligned = first_q_position == first_k_position and n == m
    if aligned and (window is None or window >= n):
        out = F.scaled_dot_product_attention(qh, k[None], v[None], is_causal=True, scale=scale)
        return out[0].transpose(0, 1)
    if trailing and 0 < n < m and (window is None or window >= m) and _FLASH_CPU is not None and q.device.type == "cpu":
        return _past_and_own_attention(q, k, v, scale)
    return _masked_attention(q, k, v, first_q_position, first_k_position, scale, window)


def _past_and_own_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk's queries [n, heads, D] over keys/values [heads, m, D] whose last n are
    the chunk's own: the past keys (all visible) and the own keys (causal) are attended
    apart, each by the flash kernel with no mask, and merged by their log-sum-exps. Equal to
    `_masked_attention` up to summation order, without its [n, m] mask, which sends SDPA to a
    slower path and is itself costly to build on long prompts (docs/benchmarks.md,
    'Measurements behind design choices')."""
    n, m = q.shape[0], k.shape[1]
    # the kernel misreads inputs whose last dimension is strided: hand it contiguous ones
    qh = q.transpose(0, 1).contiguous()[None]
    own_out, own_lse = _FLASH_CPU(qh, k[None, :, m - n:].contiguous(), v[None, :, m - n:].contiguous(), 0.0, True,
                                  scale=scale)
    past_out, past_lse = _FLASH_CPU(qh, k[None, :, :m - n].contiguous(), v[None, :, :m - n].contiguous(), 0.0,
                                    False, scale=scale)
    merge = LseMerge(own_out.float(), own_lse)  # every query sees its own key: a finite seed
    merge.add(past_out.float(), past_lse)
    return merge.out[0].transpose(0, 1).to(q.dtype)


def _window_tile(window: int) -> int:
    """Queries per tile of windowed chunk attention: one window (at least 128 for few calls)."""
    return max(window, 128)


def _window_tiles(n: int, m: int, first_q_position: int, first_k_position: int,
                  window: int) -> list[tuple[int, int, int, int]]:
    """(query start, query count, key lo, key hi) per tile: keys [lo, hi) are those any query
    of the tile can see, (p - window, p], clipped to the key range."""
    tile = _window_tile(window)
    tiles = []
    for start in range(0, n, tile):
        count = min(tile, n - start)
        first, last = first_q_position + start, first_q_position + start + count - 1
        lo = max(0, first - window + 1 - first_k_position)
        hi = min(m, last + 1 - first_k_position)
        tiles.append((start, count, lo, hi))
    return tiles


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_q_position: int,
                      first_k_position: int, scale: float, window: int | None) -> torch.Tensor:
    """Queries [n, heads, D] over keys/values already expanded to [heads, m, D], with an explicit mask."""
    n, m = q.shape[0], k.shape[1]
    q_pos = torch.arange(first_q_position, first_q_position + n, device=q.device)
    k_pos = torch.arange(first_k_position, first_k_position + m, device=q.device)
    mask = visibility_mask(q_pos, k_pos, window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def select_pages(pages: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """pages.index_select(1, ids); float8 pages go through a byte view (torch's CPU
    index_select has no float8 kernel)."""
    if pages.element_size() == 1 and pages.is_floating_point():
        return pages.view(torch.uint8).index_select(1, ids).view(pages.dtype)
    return pages.index_select(1, ids)


def decode_attention(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
                     k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                     first_page_position: torch.Tensor, visible_from: torch.Tensor,
                     visible_to: torch.Tensor, scale: float, tile_pages: int,
                     k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its own new key plus stored keys, in float32.

    q [B, heads, D]; k_self/v_self [B, kv_heads, D] (the step's own token, exact);
    k_pages/v_pages head-major [kv_heads, num_pages, block, D]; page_table [B, P] page ids
    (padding entries may hold any valid id); first_page_position [B] position of the first
    token of page_table[:, 0]; stored keys at positions [visible_from, visible_to) are
    visible. Work is batched over (kv head, sequence) pairs: gathering pages from
    head-major storage yields [kv_heads, B, tokens, D] with no further copy before bmm.
    k_scales/v_scales [kv_heads, num_pages, block]: the pages hold float8 codes scaled per
    row (cache/full/fp8.py), dequantised tile by tile.
    """
    batch, heads, dim = q.shape
    kv_heads = k_self.shape[1]
    group = heads // kv_heads
    block = k_pages.shape[2]
    pairs = kv_heads * batch
    qh = (q.float() * scale).view(batch, kv_heads, group, dim).transpose(0, 1).reshape(pairs, group, dim)
    k_own = k_self.float().transpose(0, 1).reshape(pairs, dim, 1)
    v_own = v_self.float().transpose(0, 1).reshape(pairs, 1, dim)
    # The step's own key is always visible: it seeds the running max/sum, so every row is
    # finite from the start and fully masked tiles can never produce NaN.
    state = OnlineSoftmax.one_key(torch.bmm(qh, k_own), v_own)  # [pairs, group, 1], [pairs, 1, dim]
    num_pages = page_table.shape[1]
    offsets = torch.arange(tile_pages * block, device=q.device)
    for start in range(0, num_pages, tile_pages):
        ids = page_table[:, start:start + tile_pages]
        tile = ids.shape[1] * block
        flat_ids = ids.reshape(-1)
        k = select_pages(k_pages, flat_ids).view(pairs, tile, dim).float()
        v = select_pages(v_pages, flat_ids).view(pairs, tile, dim).float()
        if k_scales is not None and v_scales is not None:
            k = k * k_scales.index_select(1, flat_ids).view(pairs, tile, 1)
            v = v * v_scales.index_select(1, flat_ids).view(pairs, tile, 1)
        scores = torch.bmm(qh, k.transpose(1, 2))  # [pairs, group, tile]
        positions = first_page_position[:, None] + start * block + offsets[None, :tile]
        hidden = ((positions < visible_from[:, None]) | (positions >= visible_to[:, None])).repeat(kv_heads, 1)
        scores.masked_fill_(hidden[:, None, :], float("-inf"))
        # Hidden slots may never have been written (storage comes from torch.empty) and can
        # hold NaN/inf bits: 0 * NaN would poison the sum, so their values are zeroed too.
        state.add(scores, v.masked_fill(hidden[:, :, None], 0.0))
    out = state.result().view(kv_heads, batch, group, dim).transpose(0, 1)
    return out.reshape(batch, heads, dim).to(q.dtype)


def gathered_decode_attention(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
                              k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                              first_page_position: torch.Tensor, visible_from: torch.Tensor,
                              visible_to: torch.Tensor, scale: float,
                              k_scales: torch.Tensor | None = None,
                              v_scales: torch.Tensor | None = None,
                              hidden: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention`'s result (same arguments, no tiles) in q's dtype.

    Grouped-query attention without repeating K/V: the `group` query heads that share a KV
    head are that head's `group` queries, [B, kv_heads, group, D], all with the same mask.
    Every page of `page_table` is gathered at once, [B, kv_heads, P * block, D], the step's own
    key appended last. Slots outside [visible_from, visible_to) are masked and their K/V
    zeroed first: storage comes from torch.empty and a NaN there would survive a mask that
    SDPA applies as an additive -inf. `hidden`: `hidden_slots(...)` of these arguments, when
    the caller computed it once for several layers.
    """
    batch, heads, dim = q.shape
    kv_heads = k_self.shape[1]
    group = heads // kv_heads
    width = page_table.shape[1] * k_pages.shape[2]
    flat_ids = page_table.reshape(-1)

    def gathered(pages: torch.Tensor, scales: torch.Tensor | None, own: torch.Tensor) -> torch.Tensor:
        rows = select_pages(pages, flat_ids).view(kv_heads, batch, width, dim)
        if scales is not None:
            rows = rows.float() * scales.index_select(1, flat_ids).view(kv_heads, batch, width, 1)
        rows = rows.to(q.dtype).masked_fill(hidden[None, :, :, None], 0.0)
        return torch.cat((rows.transpose(0, 1), own.to(q.dtype)[:, :, None, :]), dim=2)

    if hidden is None:
        hidden = hidden_slots(first_page_position, visible_from, visible_to, width)
    k = gathered(k_pages, k_scales, k_self)
    v = gathered(v_pages, v_scales, v_self)
    visible = torch.cat((~hidden, hidden.new_ones(batch, 1)), dim=1)[:, None, None, :]  # own key last
    out = F.scaled_dot_product_attention(q.view(batch, kv_heads, group, dim), k, v, attn_mask=visible, scale=scale)
    return out.reshape(batch, heads, dim)


def hidden_slots(first_page_position: torch.Tensor, visible_from: torch.Tensor, visible_to: torch.Tensor,
                 width: int) -> torch.Tensor:
    """[B, width] bool: slot i of sequence b's gathered table (position first_page_position[b]
    + i) lies outside [visible_from[b], visible_to[b])."""
    positions = first_page_position[:, None] + torch.arange(width, device=first_page_position.device)[None, :]
    return (positions < visible_from[:, None]) | (positions >= visible_to[:, None])
