"""The compiled CPU KIVI decode attention against the PyTorch path it replaces
(`kivi_decode_attention`), on the storage a real KIVI cache fills, and the cache using it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner

from kvforge.cache.kivi.attention import kivi_decode_attention
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available, kivi_decode_attention_cpu
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache

sys.path.insert(0, str(Path(__file__).parents[1] / "cache"))
from kivi_helpers import run_step  # noqa: E402

requires_kernel = pytest.mark.skipif(not cpu_kivi_kernel_available(),
                                     reason="the CPU KIVI kernel did not build (see the warning)")

HEADS, KV_HEADS, DIM, G, R = 6, 2, 32, 16, 32


def filled_cache(bits: int, window: int | None, residual_dtype: str, lengths: list[int], kernel: str = "torch"):
    """A one-layer KIVI cache holding random K/V for sequences of the given lengths."""
    torch.manual_seed(bits)
    spec = CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5, window)
    cache = create_cache(f"kivi:bits={bits},group={G},residual={R},residual_dtype={residual_dtype},"
                         f"decode_kernel={kernel}", CacheLayout.one_per_layer([spec]), 1 << 23, torch.float32)
    for seq, n in enumerate(lengths):
        if n:
            run_step(cache, {seq: (torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM) * 3,
                                   torch.randn(n, KV_HEADS, DIM))}, [0])
    return cache


@requires_kernel
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("residual_dtype", ["float32", "float16", "bfloat16"])
def test_kernel_matches_torch_path(bits, window, residual_dtype):
    lengths = [1, 20, 32, 33, 100, 161, 250]  # below, at and past residual flushes
    cache = filled_cache(bits, window, residual_dtype, lengths)
    # The cache's own decode plan for one token per sequence, then both paths on it.
    from kvforge.batch import ForwardBatch

    batch = ForwardBatch.build(list(range(len(lengths))), [[0]] * len(lengths), lengths)
    for seq, n in enumerate(lengths):
        assert cache.allocate(seq, n + 1)
    meta = cache.begin_step(batch)
    plan = meta.groups[0].decode
    view = cache.store.layer(0, 0)
    q = torch.randn(len(lengths), HEADS, DIM)
    k_self, v_self = torch.randn(len(lengths), KV_HEADS, DIM), torch.randn(len(lengths), KV_HEADS, DIM)
    args = (q, k_self, v_self, view, plan.page_table, plan.first_page_position, plan.visible_from,
            plan.lengths, plan.slots, DIM ** -0.5)
    expected = kivi_decode_attention(*args, tile_pages=3)
    got = kivi_decode_attention_cpu(*args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if window is not None:
        assert int(plan.visible_from.max()) > 0


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_queries_go_in_as_they_are_with_the_float32_result_rounded(dtype):
    """bf16/fp16 q, k_self, v_self enter the op as they are (no conversion op): the result is
    bit for bit the op on their float32 widening, rounded to their dtype once."""
    lengths = [5, 40, 161]
    cache = filled_cache(2, None, "bfloat16", lengths)
    from kvforge.batch import ForwardBatch

    batch = ForwardBatch.build(list(range(len(lengths))), [[0]] * len(lengths), lengths)
    for seq, n in enumerate(lengths):
        assert cache.allocate(seq, n + 1)
    meta = cache.begin_step(batch)
    plan = meta.groups[0].decode
    q = torch.randn(len(lengths), HEADS, DIM).to(dtype)
    k_self, v_self = (torch.randn(len(lengths), KV_HEADS, DIM).to(dtype) for _ in range(2))
    rest = (cache.store.layer(0, 0), plan.page_table, plan.first_page_position, plan.visible_from, plan.lengths,
            plan.slots, DIM ** -0.5)
    op = torch.ops.kvforge_cpu_kivi.kivi_decode_attention
    view = rest[0]
    raw = lambda a, b, c: op(a, b, c, view.k_codes, view.k_scale, view.k_zero, view.v_codes, view.v_scale,  # noqa: E731
                             view.v_zero, view.k_res, view.v_res, *rest[1:6], DIM ** -0.5, 2)
    native = raw(q, k_self, v_self)
    assert native.dtype == dtype
    assert torch.equal(native, raw(q.float(), k_self.float(), v_self.float()).to(dtype))
    assert torch.equal(kivi_decode_attention_cpu(q, k_self, v_self, *rest), native)


@requires_kernel
def test_cache_with_kernel_matches_torch_path():
    _, model = make_pair("gemma3_hybrid")
    prompts = [list(range(3, 40)), list(range(5, 12))]
    spec = "kivi:bits=2,group=8,residual=16,residual_dtype=float16"
    torch_path = decode_logits(make_runner(model, cache=spec + ",decode_kernel=torch"), prompts, 30)
    kernel = decode_logits(make_runner(model, cache=spec), prompts, 30)
    torch.testing.assert_close(kernel, torch_path, rtol=1e-4, atol=1e-4)


def test_disabled_kernel_falls_back(monkeypatch):
    monkeypatch.setenv("KVFORGE_DISABLE_CPU_KERNELS", "1")
    assert not cpu_kivi_kernel_available()
    cache = filled_cache(2, None, "float32", [40], kernel="auto")  # auto falls back to torch
    out = run_step(cache, {0: (torch.randn(1, HEADS, DIM), torch.randn(1, KV_HEADS, DIM),
                               torch.randn(1, KV_HEADS, DIM))}, [0])
    assert torch.isfinite(out[0]).all()
    with pytest.raises(RuntimeError, match="not available"):
        kivi_decode_attention_cpu(*([None] * 10))


@requires_kernel
def test_rope_tables_shorter_than_a_sequence_are_refused():
    """Pre-RoPE keys rotated at positions the tables do not cover would read past them: the
    kernel refuses, naming the sequence, and takes tables that cover every length."""
    from kvforge.batch import ForwardBatch
    from kvforge.cache.kivi.key_space import StoredKeys
    from kvforge.config import RopeConfig
    from kvforge.rope import RotaryEmbedding

    lengths = [20, 100]
    cache = filled_cache(2, None, "float32", lengths)
    batch = ForwardBatch.build([0, 1], [[0]] * 2, lengths)
    for seq, n in enumerate(lengths):
        assert cache.allocate(seq, n + 1)
    meta = cache.begin_step(batch)
    plan = meta.groups[0].decode
    q, k_self, v_self = torch.randn(2, HEADS, DIM), torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    args = (q, k_self, v_self, cache.store.layer(0, 0), plan.page_table, plan.first_page_position,
            plan.visible_from, plan.lengths, plan.slots, DIM ** -0.5)
    cos, sin = StoredKeys(RotaryEmbedding(DIM, RopeConfig(theta=100.0))).rope_tables(128)
    with pytest.raises(RuntimeError, match="RoPE tables cover 50 positions, sequence 1 holds 100"):
        kivi_decode_attention_cpu(*args, rope_tables=(cos[:, :50].contiguous(), sin[:, :50].contiguous()))
    assert torch.isfinite(kivi_decode_attention_cpu(*args, rope_tables=(cos, sin))).all()
