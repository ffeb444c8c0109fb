"""Drive a KIVI cache directly (no model) and read back what it stores, for the tests."""

from __future__ import annotations

import pytest
import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.kivi.store import dequantize_key_pages, dequantize_value_pages
from kvforge.rope import PositionedRope


def triton_test_device() -> str:
    """Where the Triton kernel tests run: "cuda", or "cpu" in Triton's interpreter (which
    tests/conftest.py turns on without a GPU); skips the test, saying why, otherwise."""
    from kvforge.cache.kivi.triton_decode import triton_available, triton_interpreted

    if not triton_available():
        pytest.skip("the `triton` package is not installed (pip install 'kvforge[triton]')")
    if torch.cuda.is_available():
        return "cuda"
    if triton_interpreted():
        return "cpu"
    pytest.skip("no CUDA, and Triton's interpreter is off (TRITON_INTERPRET was set to 0)")


def identity_rope(rows: int, dim: int, dtype: torch.dtype = torch.float32) -> PositionedRope:
    """RoPE that leaves keys as they are, in the keys' dtype (float32 tables would promote bf16 keys)."""
    return PositionedRope(cos=torch.ones(rows, dim, dtype=dtype), sin=torch.zeros(rows, dim, dtype=dtype), rotary=None)


def stored_kv(cache: KIVICache, seq_id: int, cache_layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys, values [m, H, D] float32, first position) as the cache holds them now: dequantised
    pages for quantised tokens, residual rows for the rest, from the first visible token."""
    n = cache.num_cached_tokens(seq_id)
    g, r = cache.config.group, cache.config.residual
    group, index = cache.groups.slot_of[cache_layer]
    view = cache.store.layer(index, cache_layer)
    start = cache.pages.first_kept_token(group, n)
    nk, nv = cache.quantized_keys(n), cache.quantized_values(n)
    slot = cache.residual_slot(seq_id)
    first_page = start // g
    pages = torch.tensor(cache.pages.pages(seq_id, group)[first_page:nk // g], dtype=torch.long)
    keys = torch.empty(n, *view.k_res.shape[1:2], view.k_res.shape[-1])
    values = torch.empty_like(keys)
    if pages.numel():
        base = first_page * g
        keys[base:nk] = dequantize_key_pages(view, pages).transpose(0, 1)
        values[base:nk] = dequantize_value_pages(view, pages).transpose(0, 1)
    for t in range(max(nk, start), n):
        keys[t] = view.k_res[slot, :, t % r].float()
    for t in range(max(nv, start), n):
        values[t] = view.v_res[slot, :, t % r].float()
    return keys[start:], values[start:], start


def step_batch(cache: KIVICache, lengths: dict[int, int]) -> tuple[ForwardBatch, list[int]]:
    """Storage for `lengths[seq]` new tokens of each sequence, and the step's batch (token ids
    0); also each sequence's token count before the step, in the batch's order."""
    ids = list(lengths)
    cached = [cache.num_cached_tokens(s) for s in ids]
    for seq, have in zip(ids, cached):
        assert cache.allocate(seq, have + lengths[seq])
    return ForwardBatch.build(ids, [[0] * lengths[s] for s in ids], cached), cached


def run_step(cache: KIVICache, work: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             layers: list[int]) -> dict[int, torch.Tensor]:
    """One step: work[seq] = (q [L, heads, D], k [L, H, D], v [L, H, D]) written to and read
    from every cache layer in `layers` (same K/V in each). Returns the outputs of the last layer."""
    ids = list(work)
    batch, _ = step_batch(cache, {s: work[s][1].shape[0] for s in ids})
    q = torch.cat([work[s][0] for s in ids])
    k = torch.cat([work[s][1] for s in ids])
    v = torch.cat([work[s][2] for s in ids])
    rope = identity_rope(k.shape[0], k.shape[-1], k.dtype)
    meta = cache.begin_step(batch)
    out = None
    for layer in layers:
        cache.write(layer, meta, k, v, rope)
        out = cache.attend(layer, meta, q, rope)
    cache.end_step(meta)
    assert out is not None
    return {s: out[span.query_start:span.query_end] for s, span in zip(ids, batch.spans)}
