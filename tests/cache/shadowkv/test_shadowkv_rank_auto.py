"""`rank=auto`: each layer's rank from its own pre-RoPE key spectrum at compression.

At energy=1.0 every layer keeps the full width, so outputs equal the full cache's (as
fixed full rank does); below it, the chosen rank is the definition's (smallest rank whose
top singular directions retain `energy` of ||K||_F^2, within [rank_min, width]); and the
accounted per-sequence state is exactly the bytes of the tensors it holds, per-layer ranks
and grown coefficient storage included."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from test_shadowkv import SMALL, exact_spec

from kvforge.cache.shadowkv.compress import compress_layer
from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.lowrank import key_spectrum, rank_for_energy
from kvforge.config import RopeConfig
from kvforge.rope import RotaryEmbedding


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_energy_one_keeps_full_rank_and_equals_the_full_cache(arch):
    _, model = make_pair(arch)
    layout = model.cache_layout()
    width = layout.num_kv_heads * layout.head_dim
    prompts = [list(range(3, 40)), list(range(5, 70))]
    full = decode_logits(make_runner(model), prompts, 20)
    runner = make_runner(model, cache=exact_spec(model, rank="auto", energy=1.0, rank_min=1))  # fp32 coefficients
    torch.testing.assert_close(decode_logits(runner, prompts, 20), full, atol=1e-4, rtol=0)
    stats = runner.cache.statistics()
    assert stats["compressions"] == 2 and stats["rank_mean"] == width


def _keys(n: int, heads: int, dim: int, spectrum: list[float], seed: int) -> torch.Tensor:
    """Pre-RoPE keys [n, H, D] with singular values of the given profile."""
    generator = torch.Generator().manual_seed(seed)
    width = heads * dim
    left, _ = torch.linalg.qr(torch.randn(n, width, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(width, width, generator=generator))
    return (left @ torch.diag(torch.tensor(spectrum)) @ right.T).view(n, heads, dim)


@pytest.mark.parametrize(("energy", "rank_min"), [(0.5, 1), (0.9, 1), (0.97, 1), (0.9, 12)])
def test_the_chosen_rank_is_the_definitions(energy, rank_min):
    """Keys with a decaying spectrum: compression keeps the smallest rank whose top
    directions retain `energy` of the squared norm (from an SVD here), at least rank_min;
    the basis spans those directions."""
    heads, dim, n, chunk = 2, 8, 64, 4
    singular = [0.8 ** i for i in range(heads * dim)]
    keys_pre = _keys(n, heads, dim, singular, seed=1)
    rope = RotaryEmbedding(dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)
    keys_post = rope.apply_at(keys_pre, torch.arange(n)).transpose(0, 1)
    config = ShadowKVConfig(rank="auto", energy=energy, rank_min=rank_min)
    layer, data = compress_layer(keys_post, torch.randn(heads, n, dim), rope, 48,
                                 lambda keys: config.layer_rank(keys.spectrum.energy), chunk, 1,
                                 window_capacity=16, chunks_per_step=2)
    squares = torch.linalg.svdvals(keys_pre.reshape(n, -1).double()) ** 2
    share = squares.cumsum(0) / squares.sum()
    expected = max(rank_min, int((share < energy - 1e-9).sum()) + 1)
    assert layer.basis.shape[0] == expected == data.coefficients.shape[-1]
    assert 1 < expected < heads * dim
    _, _, vh = torch.linalg.svd(keys_pre.reshape(n, -1).double(), full_matrices=False)
    projector = vh[:expected].T @ vh[:expected]
    torch.testing.assert_close((layer.basis.T @ layer.basis).double(), projector, atol=1e-4, rtol=0)


def test_rank_for_energy_reads_the_cumulative_share():
    energy = key_spectrum(_keys(40, 1, 8, [4, 2, 1, 1, 0.5, 0.1, 0.1, 0.1], seed=2).reshape(40, 8)).energy
    squares = torch.tensor([16, 4, 1, 1, 0.25, 0.01, 0.01, 0.01], dtype=torch.float64)
    torch.testing.assert_close(energy, squares.cumsum(0) / squares.sum(), atol=1e-6, rtol=0)
    assert rank_for_energy(energy, 0.70) == 1 and rank_for_energy(energy, 0.80) == 2
    assert rank_for_energy(energy, 0.99) == 5 and rank_for_energy(energy, 1.0) == 8


def _held_bytes(state) -> int:
    """Bytes of the tensors a compressed sequence's per-layer state holds."""
    return sum(t.numel() * t.element_size() for layer in state.layers
               for t in (layer.basis, layer.coefficients, layer.keys, layer.values, layer.outliers, layer.slot_ids))


def test_per_layer_ranks_are_accounted_exactly():
    """rank=auto on a 2-layer model: layers get different ranks; after compression and
    after folds that grow the coefficient storage, each sequence's accounted state equals
    the bytes its tensors hold, and the cache's total is the sum of its sequences'."""
    _, model = make_pair("llama_gqa")
    layout = model.cache_layout()
    width = layout.num_kv_heads * layout.head_dim
    spec = f"shadowkv:{SMALL},rank=auto,energy=0.8,rank_min=2,budget=8"
    runner = make_runner(model, cache=spec)
    prompts = [list(range(3, 40)), list(range(5, 70))]
    decode_logits(runner, prompts, 2)
    cache = runner.cache
    states = [entry.compressed for entry in cache._seqs.values()]
    assert all(s is not None for s in states)
    ranks = [r for s in states for r in s.ranks]
    assert min(ranks) < width and len(set(ranks)) > 1  # the spectrum decides, per layer and sequence
    capacities = [s.coefficient_capacity for s in states]
    for state in states:
        assert state.fixed_bytes == _held_bytes(state)
    assert cache._fixed_bytes == sum(s.fixed_bytes for s in states)
    stats = cache.statistics()
    assert stats["rank_mean"] == pytest.approx(sum(ranks) / len(ranks))
    # keep decoding the same sequences: folds past the initial capacity grow the storage
    runner2 = make_runner(model, cache=spec)
    decode_logits(runner2, prompts, 40)
    grown = [entry.compressed for entry in runner2.cache._seqs.values()]
    assert any(s.coefficient_capacity > c for s, c in zip(grown, capacities))
    for state in grown:
        assert state.coefficient_capacity >= state.num_chunks
        assert all(layer.coefficients.shape[0] == state.coefficient_capacity for layer in state.layers)
        assert state.fixed_bytes == _held_bytes(state)
    assert runner2.cache._fixed_bytes == sum(s.fixed_bytes for s in grown)


def test_float16_coefficients_are_the_rounded_projection_and_half_the_bytes():
    """The default coefficient storage is float16: the stored coefficients are the fp32
    projection rounded to half precision (nothing else changes), the cache accounts 2 bytes
    per coefficient, and outputs stay within half-precision rounding of the fp32 storage."""
    heads, dim, n, chunk, rank = 2, 8, 48, 4, 6
    keys_pre = _keys(n, heads, dim, [0.8 ** i for i in range(heads * dim)], seed=3)
    rope = RotaryEmbedding(dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)
    keys_post = rope.apply_at(keys_pre, torch.arange(n)).transpose(0, 1)
    values = torch.randn(heads, n, dim)
    layer, data = compress_layer(keys_post, values, rope, 40, lambda _: rank, chunk, 1, window_capacity=16,
                                 chunks_per_step=2, coefficient_dtype=torch.float16)
    assert layer.coefficients.dtype == torch.float16 and data.coefficients.dtype == torch.float32
    assert torch.equal(layer.coefficients, data.coefficients.half())
    _, model = make_pair("llama_gqa")
    prompts = [list(range(3, 40)), list(range(5, 70))]
    spec = f"shadowkv:{SMALL},rank=6,budget=8"
    half, single = make_runner(model, cache=spec), make_runner(model, cache=spec + ",coefficient_dtype=compute")
    assert half.cache.memory.sizes.coefficient_element == 2 and single.cache.memory.sizes.coefficient_element == 4
    out_half, out_single = decode_logits(half, prompts, 6), decode_logits(single, prompts, 6)
    torch.testing.assert_close(out_half, out_single, atol=2e-2, rtol=0)
    assert not torch.equal(out_half, out_single)  # the storage is really 16-bit
    for runner in (half, single):
        for entry in runner.cache._seqs.values():
            assert entry.compressed.fixed_bytes == _held_bytes(entry.compressed)


def test_compressed_global_bytes_is_what_a_compressed_sequence_holds():
    """The byte figure `kvforge info` and the ShadowKV front read (compressed_global_bytes at
    a sequence's own ranks) equals its state's tensors plus its chunk pages' fast part."""
    _, model = make_pair("llama_gqa")
    runner = make_runner(model, cache=f"shadowkv:{SMALL},rank=auto,energy=0.8,rank_min=2,budget=8")
    prompts = [list(range(3, 40)), list(range(5, 70))]
    decode_logits(runner, prompts, 1)  # compressed at the end of the prefill, nothing folded yet
    cache = runner.cache
    for seq_id, prompt in enumerate(prompts):
        state = cache._seqs[seq_id].compressed
        held = _held_bytes(state) + len(state.pages) * cache.fast_chunk_bytes
        assert cache.memory.compressed_global_bytes(len(prompt), state.ranks) == held
