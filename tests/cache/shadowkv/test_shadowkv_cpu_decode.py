"""The fused ShadowKV CPU decode kernel against the PyTorch path (its reference): same
outputs, same chunk picks and slot contents, same hit/miss counts, step after step (chunk
reuse), for GQA, batches of sequences of different lengths with scattered pages, a
sequence with fewer candidate chunks than k, reuse off, a Gemma3-like geometry (head_dim
256, one KV head), and end to end on tiny models."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner

from kvforge.cache.shadowkv.compress import compress_layer
from kvforge.cache.shadowkv.cpu_decode import cpu_shadowkv_kernel_available
from kvforge.cache.shadowkv.sparse import SparseAttention, SparseGroup
from kvforge.cache.shadowkv.state import CompressedSequence, buffer_rows
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.store import ChunkStore
from kvforge.config import RopeConfig
from kvforge.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_shadowkv_kernel_available(), reason="the CPU ShadowKV kernel did not build")

CAPACITY = 24  # window capacity of the test buffers (no folding within a test)


def _build(lengths: list[int], kv_heads: int, dim: int, chunk: int, rank: int | list[int], outliers: int, k: int,
           local: int, seed: int, kernel: bool, coefficient_dtype: torch.dtype = torch.float32
           ) -> tuple[SparseAttention, list[CompressedSequence], ShadowKVStats]:
    """One compressed layer per sequence, from random post-RoPE keys and values, its chunk
    pages scattered over the store; `rank` one for all or one per sequence (as rank=auto
    gives). Same seed: identical inputs for both paths."""
    generator = torch.Generator().manual_seed(seed)
    rope = _rope(dim)
    chunks = [(n - local) // chunk for n in lengths]
    pages = 2 * sum(chunks) + 3
    store = ChunkStore(1, kv_heads, dim, chunk, pages, torch.float32, torch.device("cpu"), "memory", None)
    ranks = rank if isinstance(rank, list) else [rank] * len(lengths)
    order = torch.randperm(pages, generator=generator).tolist()
    stats = ShadowKVStats()
    states = []
    for n, count, r in zip(lengths, chunks, ranks):
        base = torch.randn(kv_heads, 1, dim, generator=generator)  # a shared direction: landmarks differ in scale
        keys = base + torch.randn(kv_heads, n, dim, generator=generator)
        values = torch.randn(kv_heads, n, dim, generator=generator)
        layer, data = compress_layer(keys, values, rope, count * chunk, lambda _, r=r: r, chunk, outliers, CAPACITY, k,
                                     coefficient_dtype)
        assert layer.coefficients.dtype == coefficient_dtype
        assert layer.basis.shape[0] == r == layer.coefficients.shape[-1]
        ids, order = order[:count], order[count:]
        table = torch.tensor(ids, dtype=torch.long)
        store.write(0, table, data.landmarks, data.values)
        used_outliers = layer.outliers.shape[1]
        states.append(CompressedSequence(pages=ids, page_table=table, window=n - count * chunk, chunks_per_step=k,
                                         num_outliers=used_outliers,
                                         slots_start=buffer_rows(used_outliers, chunk, CAPACITY, k)[0],
                                         fixed_bytes=0, layers=[layer]))
    return SparseAttention(store, chunk, stats, reuse=True, device=torch.device("cpu"), kernel=kernel), states, stats


def _rope(dim: int):
    return RotaryEmbedding(dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)


def _step(sparse: SparseAttention, states: list[CompressedSequence], q: torch.Tensor, own_k: torch.Tensor,
          own_v: torch.Tensor, chunk: int) -> torch.Tensor:
    """One decode step as the cache runs it: the token into each window (by the kernel
    itself on its path), attend, window + 1."""
    kernel = sparse.uses_kernel(torch.float32)
    for b, state in enumerate(states):
        layer = state.layers[0]
        row = state.window_start(chunk) + state.window
        if not kernel:
            layer.keys[:, row], layer.values[:, row] = own_k[b], own_v[b]
    group = SparseGroup.build(states, list(range(len(states))), 1, True, chunk, torch.device("cpu"), kernel)
    out = sparse.attend(0, group, q[:, None], own_k[:, None], own_v[:, None], _rope(q.shape[-1]), 0.37)
    for state in states:
        state.window += 1
    return out[:, 0]


def _slot_contents(state: CompressedSequence, chunk: int) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per KV head: chunk id -> (keys, values) of the slot holding it (slot order aside)."""
    layer = state.layers[0]
    heads = []
    for h in range(layer.slot_ids.shape[0]):
        held = {}
        for j, c in enumerate(layer.slot_ids[h].tolist()):
            if c >= 0:
                rows = slice(state.slots_start + j * chunk, state.slots_start + (j + 1) * chunk)
                held[c] = (layer.keys[h, rows], layer.values[h, rows])
        heads.append(held)
    return heads


@pytest.mark.parametrize(("kv_heads", "heads", "dim", "lengths", "k", "reuse", "rank", "half"), [
    (2, 6, 16, [72, 104, 28], 4, True, 5, False),  # GQA, three lengths; the last has 3 candidates < k
    (2, 6, 16, [72, 104, 28], 4, True, [5, 11, 2], True),  # each sequence its own rank (rank=auto), fp16 storage
    (2, 6, 16, [72, 104], 4, False, 5, False),  # no reuse: every pick is a miss
    (1, 4, 256, [64, 80], 3, True, [5, 40], True),  # Gemma3-like: head_dim 256, one KV head
])
def test_kernel_equals_the_pytorch_path(kv_heads, heads, dim, lengths, k, reuse, rank, half):
    chunk, outliers, local = 4, 2, 8
    dtype = torch.float16 if half else torch.float32
    ref, ref_states, ref_stats = _build(lengths, kv_heads, dim, chunk, rank, outliers, k, local, 0, False, dtype)
    fast, fast_states, fast_stats = _build(lengths, kv_heads, dim, chunk, rank, outliers, k, local, 0, True, dtype)
    ref.reuse = fast.reuse = reuse
    assert not ref.uses_kernel(torch.float32) and fast.uses_kernel(torch.float32)
    generator = torch.Generator().manual_seed(1)
    batch = len(lengths)
    q = torch.randn(batch, heads, dim, generator=generator)
    for _ in range(8):
        q = q + 0.4 * torch.randn(batch, heads, dim, generator=generator)  # drifting queries: hits and misses
        own_k, own_v = torch.randn(2, batch, kv_heads, dim, generator=generator)
        expected = _step(ref, ref_states, q, own_k, own_v, chunk)
        got = _step(fast, fast_states, q, own_k, own_v, chunk)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        for ref_state, fast_state in zip(ref_states, fast_states):
            ref_slots, fast_slots = _slot_contents(ref_state, chunk), _slot_contents(fast_state, chunk)
            for ref_head, fast_head in zip(ref_slots, fast_slots):
                assert sorted(ref_head) == sorted(fast_head)  # the same chunks selected
                for c, (keys, values) in ref_head.items():
                    torch.testing.assert_close(fast_head[c][0], keys, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(fast_head[c][1], values, atol=0, rtol=0)
    assert (fast_stats.chunk_hits, fast_stats.chunk_misses) == (ref_stats.chunk_hits, ref_stats.chunk_misses)
    assert fast_stats.chunk_misses > 0 and (fast_stats.chunk_hits > 0) == reuse
    assert fast_stats.seconds["selection"] > 0 and fast_stats.seconds["attention"] > 0
    short = fast_states[-1]
    if short.num_chunks - short.num_outliers < k:  # fewer candidates than slots: some stay empty
        assert (short.layers[0].slot_ids == -1).any()


@pytest.mark.parametrize(("arch", "rank"), [("llama_gqa", "rank=3"), ("gemma3_hybrid", "rank=3"),
                                            ("llama_gqa", "rank=auto,energy=0.9,rank_min=2")])
def test_tiny_model_logits_equal_with_and_without_the_kernel(arch, rank):
    """A lossy configuration (low rank, small budget: selection matters), batched decode with
    folding: the kernel's logits equal the PyTorch path's."""
    _, model = make_pair(arch)
    prompts = [list(range(3, 60)), list(range(5, 90))]
    spec = f"shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,{rank},budget=8"
    reference = make_runner(model, cache=spec + ",kernel=0")
    fast = make_runner(model, cache=spec + ",kernel=1")
    expected = decode_logits(reference, prompts, 16)
    got = decode_logits(fast, prompts, 16)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    ref_stats, fast_stats = reference.cache.statistics(), fast.cache.statistics()
    assert fast_stats["chunk_misses"] == ref_stats["chunk_misses"] > 0
    assert fast_stats["chunk_hits"] == ref_stats["chunk_hits"]
    assert fast_stats["folded_chunks"] > 0


def test_disabled_kernels_use_the_pytorch_path(monkeypatch):
    sparse, _, _ = _build([40], 1, 8, 4, 3, 1, 2, 8, 0, kernel=True)
    assert sparse.uses_kernel(torch.float32)
    monkeypatch.setenv("KVFORGE_DISABLE_CPU_KERNELS", "1")
    assert not sparse.uses_kernel(torch.float32)
