"""`full`'s fused RoPE-and-store (cache/full/triton_store.py) against the path it replaces on
CUDA: the Triton RoPE, then one `index_copy_` per page store. Bitwise, on CUDA or in
Triton's CPU interpreter; and the cache taking it only where it applies."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from triton_helpers import kernel_device

from kvforge.cache.full.method import FullCache
from kvforge.kernels import cuda_fused
from kvforge.kernels.cuda_fused import DISABLE_TRITON_FUSED_ENV
from kvforge.models.layers import pack_projections

ROWS, HEADS, DIM, PAGES, BLOCK = 5, 3, 16, 6, 4


def operands(dtype: torch.dtype, device: str, packed: bool) -> tuple[torch.Tensor, ...]:
    """k_pre, v [ROWS, HEADS, DIM] (packed: slices of one wider row, as a packed q/k/v GEMM
    leaves them), cos, sin [ROWS, DIM], distinct slots [ROWS]."""
    gen = torch.Generator().manual_seed(7)
    width = HEADS * DIM
    if packed:
        qkv = torch.randn(ROWS, 4 * width, generator=gen).to(dtype).to(device)
        k_pre, v = qkv[:, 2 * width:3 * width].view(ROWS, HEADS, DIM), qkv[:, 3 * width:].view(ROWS, HEADS, DIM)
        assert not k_pre.is_contiguous()
    else:
        k_pre, v = (torch.randn(ROWS, HEADS, DIM, generator=gen).to(dtype).to(device) for _ in range(2))
    angles = torch.rand(ROWS, DIM // 2, generator=gen) * 40
    angles = torch.cat((angles, angles), dim=-1)
    slots = torch.randperm(PAGES * BLOCK, generator=gen)[:ROWS].to(device)
    return k_pre, v, angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device), slots


@pytest.mark.parametrize("dtype,page_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed"])
def test_rope_and_store_is_the_rope_then_both_page_stores(dtype, page_dtype, packed, monkeypatch):
    device = kernel_device()
    if device == "cpu" and dtype == torch.float32 and page_dtype == torch.bfloat16:
        # Triton's interpreter stores float32 into bfloat16 by truncation, where CUDA (and
        # torch) round to nearest even: this pairing is held bitwise on a GPU only
        pytest.skip("the interpreter truncates float32 to bfloat16")
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", device)
    from kvforge.cache.full.triton_store import rope_and_store, rope_store_applies
    from kvforge.kernels.triton_fused import rope_rotate_triton

    k_pre, v, cos, sin, slots = operands(dtype, device, packed)
    pages = [torch.full((HEADS, PAGES, BLOCK, DIM), 3.0, dtype=page_dtype, device=device) for _ in range(2)]
    expected_pages = [p.clone() for p in pages]
    expected_k = rope_rotate_triton(k_pre, cos, sin)  # the CUDA path's RoPE
    for store, rows in zip(expected_pages, (expected_k, v)):
        store.view(HEADS, -1, DIM).index_copy_(1, slots, rows.transpose(0, 1).to(page_dtype))
    assert rope_store_applies(k_pre, v, cos, sin, *pages)
    k = rope_and_store(k_pre, v, cos, sin, *pages, slots)
    assert k.is_contiguous() and torch.equal(k, expected_k)
    assert torch.equal(pages[0], expected_pages[0]) and torch.equal(pages[1], expected_pages[1])  # other slots kept


def test_what_the_fused_store_cannot_take_is_refused(monkeypatch):
    device = kernel_device()
    from kvforge.cache.full.triton_store import rope_store_applies

    k_pre, v, cos, sin, _ = operands(torch.float32, device, packed=False)
    pages = [torch.zeros(HEADS, PAGES, BLOCK, DIM, device=device) for _ in range(2)]
    assert rope_store_applies(k_pre, v, cos, sin, *pages)
    assert not rope_store_applies(k_pre.transpose(0, 1).contiguous().transpose(0, 1), v, cos, sin, *pages)
    assert not rope_store_applies(k_pre, v.to(torch.bfloat16), cos, sin, *pages)  # mixed dtypes
    assert not rope_store_applies(k_pre, v, cos, sin, pages[0], pages[1].to(torch.bfloat16))
    assert not rope_store_applies(k_pre, v, cos[:, :8], sin[:, :8], *pages)  # partial tables
    monkeypatch.setenv(DISABLE_TRITON_FUSED_ENV, "1")  # the fused ops' switch turns it off too
    assert not rope_store_applies(k_pre, v, cos, sin, *pages)


@pytest.mark.parametrize("name", ["qwen2_bias", "mistral_window"])
@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
def test_the_cache_stores_what_the_pytorch_path_stores(name, packed, monkeypatch):
    """Prefill and decode steps of a model through `full:decode_kernel=triton`: the fused write
    runs in every layer and the pages and logits are the PyTorch path's (its switch off).
    qwen2_bias: biased q/k/v (a packed GEMM's bias slices too); mistral_window: a 17-token
    prompt in a 12-token window stores only its last rows, through the PyTorch path."""
    device = kernel_device()
    if device != "cpu":
        pytest.skip("runs the interpreter on the CPU (the CUDA path is test_full_triton_decode's)")
    from kvforge.cache.full import triton_store

    calls: list[int] = []
    fused = triton_store.rope_and_store
    monkeypatch.setattr(triton_store, "rope_and_store", lambda *args: calls.append(1) or fused(*args))
    spec, prompts = "full:block_size=4,decode_kernel=triton", [list(range(3, 20)), [7, 8, 9]]
    results = []
    for disabled in ("1", ""):
        monkeypatch.setenv(DISABLE_TRITON_FUSED_ENV, disabled)
        model = make_pair(name)[1]
        if packed:
            pack_projections(model)
        runner = make_runner(model, spec)
        cache = runner.cache
        assert isinstance(cache, FullCache)
        cache.k_store.zero_(), cache.v_store.zero_()  # (allocated empty: unwritten slots would differ)
        logits = decode_logits(runner, prompts, steps=3)
        results.append((logits, cache.k_store.clone(), cache.v_store.clone()))
    layers = len(model.model.layers)
    steps = 4 if name == "qwen2_bias" else 3  # (the windowed prefill stores a subset of its rows)
    assert len(calls) == steps * layers  # each step, every layer; none while switched off
    (ref_logits, ref_k, ref_v), (logits, k, v) = results
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
