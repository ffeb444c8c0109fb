"""Every code path of the compiled CPU KIVI decode attention against the PyTorch reference
`kivi_decode_attention`, on synthetic stores: bit widths, group sizes that take the native,
8-lane and scalar vector paths, residual dtypes, GQA groups (including groups that need
several passes), sliding windows that start inside a page, split-K over long sequences and
thread counts.

Storage the contract says is never read (values of tokens still in the ring, ring rows of
other or hidden tokens, key ring rows past n) is filled with NaN, so reading it anywhere
would show in the output."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvforge.cache.kivi.attention import kivi_decode_attention
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available, kivi_decode_attention_cpu
from kvforge.cache.kivi.store import KIVILayerView

pytestmark = pytest.mark.skipif(not cpu_kivi_kernel_available(),
                                reason="the CPU KIVI kernel did not build (see the warning)")

NAN = float("nan")


def make_case(lengths: list[int], kv_heads: int = 2, group: int = 3, dim: int = 64, g: int = 32, r: int = 64,
              bits: int = 2, residual_dtype: torch.dtype = torch.float32, window: int | None = None,
              padding: int = 2, seed: int = 0) -> dict:
    """Random decode inputs over a random page pool. Sequence b holds lengths[b] tokens; with
    a window it sees tokens from n - window + 1 and keeps pages from the one holding them."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads = len(lengths), kv_heads * group
    starts = [0 if window is None else max(0, n - window + 1) for n in lengths]
    nks = [(n // r) * r for n in lengths]
    nvs = [max(0, n - r) for n in lengths]
    firsts = [(s // g) * g for s in starts]
    columns = [max(0, (nk - f) // g) for nk, f in zip(nks, firsts)]
    pages = sum(columns) + 3
    order = torch.randperm(pages, generator=gen).tolist()
    tables = [[order.pop() for _ in range(c)] for c in columns]
    width = max(columns) + padding
    table = torch.tensor([t + torch.randint(pages, (width - len(t),), generator=gen).tolist() for t in tables],
                         dtype=torch.long).reshape(batch, width)
    levels = (1 << bits) - 1

    def params(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (torch.rand(shape, generator=gen) * 0.3 + 0.02) * 3 / levels
        return scale.half(), (torch.randn(shape, generator=gen) * 0.5).half()

    k_codes = torch.randint(0, 256, (kv_heads, pages, dim, g * bits // 8), generator=gen, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (kv_heads, pages, g, dim * bits // 8), generator=gen, dtype=torch.uint8)
    k_scale, k_zero = params(kv_heads, pages, dim)
    v_scale, v_zero = params(kv_heads, pages, g, dim // g)
    slots_total = batch + 2
    slots = torch.randperm(slots_total, generator=gen)[:batch]
    k_res = torch.randn(slots_total, kv_heads, r, dim, generator=gen).to(residual_dtype)
    v_res = torch.randn(slots_total, kv_heads, r, dim, generator=gen).to(residual_dtype)
    # Poison what must not be read.
    for b, n in enumerate(lengths):
        for t in range(firsts[b], nks[b]):
            page = tables[b][(t - firsts[b]) // g]
            if t >= nvs[b] or t < starts[b]:  # value still in the ring, or hidden
                v_scale[:, page, t % g] = NAN
                v_zero[:, page, t % g] = NAN
        used_k = {t % r for t in range(max(nks[b], starts[b]), n)}
        used_v = {t % r for t in range(max(nvs[b], starts[b]), n)}
        for offset in range(r):
            if offset not in used_k:
                k_res[slots[b], :, offset] = NAN
            if offset not in used_v:
                v_res[slots[b], :, offset] = NAN
    view = KIVILayerView(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, bits)
    return dict(q=torch.randn(batch, heads, dim, generator=gen), k_self=torch.randn(batch, kv_heads, dim, generator=gen),
                v_self=torch.randn(batch, kv_heads, dim, generator=gen), view=view, page_table=table,
                first_page_position=torch.tensor(firsts), visible_from=torch.tensor(starts),
                lengths=torch.tensor(lengths), slots=slots, scale=dim ** -0.5)


def check(case: dict) -> torch.Tensor:
    got = kivi_decode_attention_cpu(**case)
    expected = kivi_decode_attention(**case, tile_pages=2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return got


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` inside the block, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def lengths_for(r: int, g: int) -> list[int]:
    """Below, at and past residual flushes, and a few pages of quantised tokens."""
    return [0, 1, g - 1, r - 1, r, r + 1, 2 * r + g + 3, 5 * r + 7]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("g,dim", [(32, 64), (16, 48), (64, 64), (8, 64), (24, 48), (4, 32), (12, 48)],
                         ids=["G32-native", "G16-native-odd-blocks", "G64-native", "G8-8lane", "G24-8lane",
                              "G4-scalar", "G12-scalar"])
def test_group_sizes_and_bits(bits, g, dim):
    r = 2 * g if g < 64 else g
    check(make_case(lengths_for(r, g), g=g, r=r, dim=dim, bits=bits, seed=bits + g))


@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_residual_dtypes(residual_dtype, bits):
    check(make_case(lengths_for(64, 32), bits=bits, residual_dtype=residual_dtype))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12])
def test_gqa_groups(group):
    # groups above 8 run in several passes over the codes
    check(make_case([5, 70, 300], kv_heads=2, group=group, seed=group))


@pytest.mark.parametrize("group", [3, 5])
def test_gqa_groups_on_the_8_lane_path(group):
    check(make_case([5, 70, 300], kv_heads=1, group=group, g=8, r=16, seed=group))


@pytest.mark.parametrize("window", [1, 7, 40, 100, 333])
@pytest.mark.parametrize("g", [16, 32])
def test_sliding_windows(window, g):
    case = make_case([3, 50, 129, 200, 777, 1000], g=g, r=64, window=window, seed=window)
    starts, firsts = case["visible_from"], case["first_page_position"]
    assert (firsts > 0).any() and (starts > firsts).any()  # released pages, a window starting mid-page
    check(case)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 3000])
def test_long_sequences_split_over_threads(threads, window):
    # one (sequence, kv head) pair of thousands of tokens is cut into slices merged by
    # log-sum-exp; the result must not depend on the thread count
    with torch_threads(threads):
        out = check(make_case([5000], kv_heads=1, group=4, window=window))
    with torch_threads(1 if threads == 2 else 2):
        torch.testing.assert_close(kivi_decode_attention_cpu(**make_case([5000], kv_heads=1, group=4,
                                                                          window=window)), out, rtol=1e-6, atol=1e-6)


def test_only_the_own_token():
    case = make_case([0, 0], kv_heads=2, group=3)
    out = check(case)
    torch.testing.assert_close(out, case["v_self"].repeat_interleave(3, dim=1), rtol=0, atol=1e-6)


def test_padding_entries_are_ignored():
    case = make_case([40, 300, 130], padding=4)
    out = kivi_decode_attention_cpu(**case)
    table = case["page_table"].clone()
    used = ((case["lengths"] // 64) * 64 - case["first_page_position"]) // 32
    for row, count in enumerate(used.tolist()):
        table[row, count:] = -1
    torch.testing.assert_close(kivi_decode_attention_cpu(**{**case, "page_table": table}), out, rtol=0, atol=0)


def test_bad_page_id_is_reported():
    case = make_case([300])
    case["page_table"][0, 0] = case["view"].k_codes.shape[1]
    with pytest.raises(RuntimeError, match="out of range"):
        kivi_decode_attention_cpu(**case)
