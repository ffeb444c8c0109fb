"""Attention over KIVI storage in plain PyTorch: the reference every fast path matches.

Both paths read the stored past tile by tile and merge tiles with an online softmax in
float32, so no sequence's cache is ever dequantised whole:
- `kivi_chunk_attention`: the queries of one prefill chunk over the chunk's own exact K/V
  (causal) plus the stored past;
- `kivi_decode_attention`: one query per sequence for a batch of sequences (the contract in
  /work/notes/kivi_layout.md, shared with the C++ and Triton kernels).

Stored token t of a sequence with n tokens (nk = (n // R) * R, nv = max(0, n - R)):
key = k_sink[slot, :, t] if t < sinks, else dequantised page if t < nk, else k_res[slot, :, t % R];
value = v_sink[slot, :, t] if t < sinks, else dequantised page if t < nv, else v_res[slot, :, t % R];
then `key_transform` (key_space.py; None: keys are stored as attention reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvforge.cache.kivi.int8_keys import int8_key_scores
from kvforge.cache.kivi.int8_values import int8_value_sums
from kvforge.cache.kivi.key_space import KeyTransform
from kvforge.cache.kivi.plan import residual_split
from kvforge.cache.kivi.store import KIVILayerView, dequantize_key_pages, dequantize_value_pages
from kvforge.cache.softmax_merge import OnlineSoftmax
from kvforge.host_sync import host_memory


def _hide(scores: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask hidden keys. hidden [P, rows, m] or broadcastable; values of keys hidden from
    every row are zeroed (never-written storage may hold NaN, and 0 * NaN = NaN)."""
    scores = scores.masked_fill(hidden, float("-inf"))
    unused = hidden.all(dim=-2)  # [P, m]
    return scores, values.masked_fill(unused[..., None], 0.0)


def with_sinks(view: KIVILayerView, slots: torch.Tensor | int, k_pos: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values [H, *lead, m, D] of tokens at k_pos [*lead, m] with the tokens below
    `view.sinks` taken from the sink buffers of `slots` (an int, or [*lead] per row)."""
    n_sinks = view.sinks
    if not n_sinks or view.k_sink is None or view.v_sink is None:
        return keys, values
    sink = k_pos < n_sinks
    if host_memory(k_pos.device) and not bool(sink.any()):
        return keys, values
    index = k_pos.clamp(max=n_sinks - 1)
    if isinstance(slots, int):
        exact_k, exact_v = view.k_sink[slots][:, index], view.v_sink[slots][:, index]
    else:  # per row: [H, B, m, D]
        heads, dim = keys.shape[0], keys.shape[-1]
        gather = index[None, :, :, None].expand(heads, -1, -1, dim)
        exact_k = torch.gather(view.k_sink.index_select(0, slots).transpose(0, 1), 2, gather)
        exact_v = torch.gather(view.v_sink.index_select(0, slots).transpose(0, 1), 2, gather)
    mask = sink[None, ..., None]
    return torch.where(mask, exact_k.float(), keys), torch.where(mask, exact_v.float(), values)


def stored_tiles(view: KIVILayerView, pages: torch.Tensor, first_page_position: int, past_from: int, nv: int,
                 slot: int, tile_pages: int, key_transform: KeyTransform = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The quantised pages `pages` (tokens from first_page_position on, in order) of one
    sequence, `tile_pages` at a time, as (positions [m], keys [H, m, D], values [H, m, D])
    in float32; tiles wholly before `past_from` are skipped. Tokens >= nv still have their
    exact values in the residual ring, which replace the (not yet written) quantised ones;
    sink tokens come from the sink buffers. At most one tile is ever dequantised at once."""
    g, residual = view.group, view.residual
    v_ring = view.v_res[slot]  # [H, R, D]
    for start in range(0, pages.shape[0], tile_pages):
        ids = pages[start:start + tile_pages]
        k_pos = first_page_position + start * g + torch.arange(ids.shape[0] * g, device=pages.device)
        if int(k_pos[-1]) < past_from:
            continue
        keys = dequantize_key_pages(view, ids)
        values = dequantize_value_pages(view, ids)
        recent = k_pos >= nv
        if bool(recent.any()):
            values = torch.where(recent[None, :, None], v_ring[:, k_pos % residual].float(), values)
        keys, values = with_sinks(view, slot, k_pos, keys, values)
        yield k_pos, keys if key_transform is None else key_transform(keys, k_pos), values


def stored_parts(view: KIVILayerView, pages: torch.Tensor, first_page_position: int, past_from: int,
                 cached_len: int, slot: int, tile_pages: int, key_transform: KeyTransform = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Everything one sequence stores before a chunk, as float32 (positions [m], keys
    [H, m, D], values [H, m, D]) parts in position order: the quantised pages a tile at a
    time (`stored_tiles`), then the key residual [max(nk, past_from), n), whose keys and
    values both come from the residual rings (never more than R tokens; sink tokens there
    are exact already)."""
    n, residual = cached_len, view.residual
    nk, nv = (n // residual) * residual, max(0, n - residual)
    yield from stored_tiles(view, pages, first_page_position, past_from, nv, slot, tile_pages, key_transform)
    res_from = max(nk, past_from)
    if n > res_from:
        k_pos = torch.arange(res_from, n, device=pages.device)
        offsets = k_pos % residual
        keys = view.k_res[slot][:, offsets].float()
        yield k_pos, keys if key_transform is None else key_transform(keys, k_pos), view.v_res[slot][:, offsets].float()


def kivi_chunk_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, view: KIVILayerView,
                         pages: torch.Tensor, first_page_position: int, past_from: int, cached_len: int,
                         slot: int, scale: float, window: int | None, tile_pages: int,
                         key_transform: KeyTransform = None) -> torch.Tensor:
    """Queries q [L, heads, D] at positions [cached_len, cached_len + L) over their own exact
    k_new/v_new [L, H, D] (attention keys) and the stored tokens [past_from, cached_len) of
    one sequence. `pages` [m] holds tokens [first_page_position, nk) (nk = stored keys), in order."""
    length, heads, dim = q.shape
    kv_heads = k_new.shape[1]
    group = heads // kv_heads
    n = cached_len
    device = q.device
    # Rows of a kv head: its `group` query heads x L positions -> [H, group * L, D].
    qh = (q.float() * scale).view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    q_pos = torch.arange(n, n + length, device=device).repeat(group)  # position of each row

    def hidden_at(k_pos: torch.Tensor) -> torch.Tensor:
        delta = q_pos[:, None] - k_pos[None, :]
        hidden = (delta < 0) | (k_pos[None, :] < past_from)
        if window is not None:
            hidden |= delta >= window
        return hidden[None]

    own_k, own_v = k_new.float().transpose(0, 1), v_new.float().transpose(0, 1)
    scores, values = _hide(torch.bmm(qh, own_k.transpose(1, 2)), own_v,
                           hidden_at(torch.arange(n, n + length, device=device)))
    state = OnlineSoftmax.first_tile(scores, values)
    for k_pos, keys, values in stored_parts(view, pages, first_page_position, past_from, n, slot, tile_pages,
                                            key_transform):
        scores, values = _hide(torch.bmm(qh, keys.transpose(1, 2)), values, hidden_at(k_pos))
        state.add(scores, values)
    out = state.result().view(kv_heads, group, length, dim).permute(2, 0, 1, 3)
    return out.reshape(length, heads, dim).to(q.dtype)


def _int8_weigh(view: KIVILayerView, ids: torch.Tensor, values: torch.Tensor, quantised: torch.Tensor,
                hidden: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """OnlineSoftmax's `weigh` for one decode tile under value_dot=int8: the tokens marked
    quantised [B, m] through int8_value_sums, the other visible ones (ring, sinks) exactly
    from `values` [H, B, m, D]; hidden [B, m] tokens' values are never read (they may be
    NaN: storage never written)."""
    heads, batch, tile, dim = values.shape
    exact = values.masked_fill((quantised | hidden)[None, :, :, None], 0.0).reshape(heads * batch, tile, dim)

    def weigh(probs: torch.Tensor) -> torch.Tensor:  # probs [pairs, group, m]
        group = probs.shape[1]
        sums = int8_value_sums(probs.view(heads, batch, group, tile), view, ids, quantised)
        return torch.bmm(probs, exact) + sums.reshape(heads * batch, group, dim)

    return weigh


def kivi_decode_attention(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor, view: KIVILayerView,
                          page_table: torch.Tensor, first_page_position: torch.Tensor,
                          visible_from: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                          scale: float, tile_pages: int, key_transform: KeyTransform = None,
                          key_dot: str = "float", value_dot: str = "float") -> torch.Tensor:
    """One query per sequence over its own exact K/V plus its stored tokens, float32.
    key_dot="int8" scores the quantised pages' keys as int8_keys.py defines (post-RoPE
    keys only: key_transform must be None); value_dot="int8" sums the quantised pages'
    values as int8_values.py defines.

    q [B, heads, D]; k_self/v_self [B, H, D]; page_table [B, W] pages of tokens
    [first_page_position, nk); stored tokens [visible_from, lengths) are visible; slots [B]
    residual slot of each sequence. Work is batched over (kv head, sequence) pairs."""
    batch, heads, dim = q.shape
    kv_heads = k_self.shape[1]
    group = heads // kv_heads
    pairs = kv_heads * batch
    residual, g = view.residual, view.group
    nk, nv = residual_split(lengths, residual)
    qh = (q.float() * scale).view(batch, kv_heads, group, dim).transpose(0, 1).reshape(pairs, group, dim)
    own_k = k_self.float().transpose(0, 1).reshape(pairs, dim, 1)
    own_v = v_self.float().transpose(0, 1).reshape(pairs, 1, dim)
    state = OnlineSoftmax.first_tile(torch.bmm(qh, own_k), own_v)

    def add(keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
            scores: torch.Tensor | None = None, weigh: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # keys/values [H, B, m, D]; hidden [B, m]; scores [pairs, group, m] if given
        hidden = hidden.repeat(kv_heads, 1)[:, None, :]  # [pairs, 1, m]
        if scores is None:
            scores = torch.bmm(qh, keys.reshape(pairs, -1, dim).transpose(1, 2))
        scores, values = _hide(scores, values.reshape(pairs, -1, dim), hidden)
        state.add(scores, values, weigh)

    # The skips below read device values: taken on the CPU only (host_sync). Elsewhere a
    # tile nobody sees adds exp(-inf) = 0 to every sum, and ring values replace nothing
    # where no token is recent: the same result without a synchronisation.
    skips = host_memory(q.device)
    ring = view.v_res.index_select(0, slots).transpose(0, 1)  # [H, B, R, D] (small: R tokens)
    width = page_table.shape[1]
    for start in range(0, width, tile_pages):
        ids = page_table[:, start:start + tile_pages]
        tile = ids.shape[1] * g
        k_pos = first_page_position[:, None] + start * g + torch.arange(tile, device=q.device)[None]  # [B, m]
        hidden = (k_pos < visible_from[:, None]) | (k_pos >= nk[:, None])
        if skips and bool(hidden.all()):
            continue
        flat = ids.reshape(-1)
        keys = dequantize_key_pages(view, flat).view(kv_heads, batch, tile, dim)
        values = dequantize_value_pages(view, flat).view(kv_heads, batch, tile, dim)
        recent = (k_pos >= nv[:, None]) & ~hidden
        if not skips or bool(recent.any()):
            from_ring = torch.gather(ring, 2, (k_pos % residual)[None, :, :, None].expand(kv_heads, -1, -1, dim))
            values = torch.where(recent[None, :, :, None], from_ring.float(), values)
        keys, values = with_sinks(view, slots, k_pos, keys, values)
        scores = None
        if key_dot == "int8":
            assert key_transform is None, "key_dot=int8 scores post-RoPE keys only"
            scores = int8_key_scores(qh.view(kv_heads, batch, group, dim), view, ids).reshape(pairs, group, tile)
            if view.sinks:  # sink tokens keep exact keys (and exact scores)
                exact = torch.bmm(qh, keys.reshape(pairs, -1, dim).transpose(1, 2))
                sink = (k_pos < view.sinks).repeat(kv_heads, 1)[:, None, :]
                scores = torch.where(sink, exact, scores)
        weigh = None
        if value_dot == "int8":
            weigh = _int8_weigh(view, ids, values, (k_pos < nv[:, None]) & (k_pos >= view.sinks) & ~hidden, hidden)
        add(keys if key_transform is None else key_transform(keys, k_pos), values, hidden, scores, weigh)
    # Residual keys: tokens [nk, n) at offsets 0 .. n - nk - 1 of both residuals.
    k_pos = nk[:, None] + torch.arange(residual, device=q.device)[None]
    hidden = (k_pos >= lengths[:, None]) | (k_pos < visible_from[:, None])
    if not skips or not bool(hidden.all()):
        keys = view.k_res.index_select(0, slots).transpose(0, 1).float()
        add(keys if key_transform is None else key_transform(keys, k_pos), ring.float(), hidden)
    out = state.result().view(kv_heads, batch, group, dim).transpose(0, 1)
    return out.reshape(batch, heads, dim).to(q.dtype)
