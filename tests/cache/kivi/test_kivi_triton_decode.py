"""KIVI decode attention: the PyTorch reference against `reference_attention` over explicitly
dequantised K/V (always), and the Triton kernel against the reference (on CUDA, or in
Triton's CPU interpreter, which tests/conftest.py turns on without a GPU; skipped, with the
reason, without the `triton` package)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from kivi_helpers import triton_test_device
from triton_helpers import warps_of_launches

from kvforge.cache.attention import reference_attention
from kvforge.cache.kivi import triton_decode
from kvforge.cache.kivi.decode_reference import kivi_decode_attention_reference
from kvforge.cache.kivi.quant import dequantize, quantize
from kvforge.cache.kivi.triton_decode import (
    kivi_decode_attention_triton,
    triton_available,
    triton_interpreted,
)
from kvforge.errors import ConfigError
from kvforge.kernels import triton_jit
from kvforge.kernels.triton_jit import triton_interpreting

GROUP, RESIDUAL, KV_HEADS, QUERY_GROUP, DIM = 16, 32, 2, 3, 32
LENGTHS = [0, 5, 40, 77, 130]  # below, at and past the residual; 130 = 4 key flushes + 2


def contract_split(n: int) -> tuple[int, int]:
    """(nk, nv) of the KIVI residual rules: keys flushed every RESIDUAL tokens, values a
    sliding window of the last RESIDUAL tokens."""
    return (n // RESIDUAL) * RESIDUAL, max(0, n - RESIDUAL)


def free_split(n: int) -> tuple[int, int]:
    """nk and nv off the residual rules (nv > nk for most lengths; both residual spans still
    fit the ring): the kernels select per token, so any such split must work."""
    return math.ceil(max(0, n - RESIDUAL) / GROUP) * GROUP, n - n // 5


def ragged_split(n: int) -> tuple[int, int]:
    """nk and nv inside pages (the contract allows it; the cache's rules never make it): the
    page holding token nk is quantised whole, and its keys from nk on are read from the ring."""
    return max(0, n - RESIDUAL // 2 - 1), max(0, n - RESIDUAL + 5)


def make_case(lengths: list[int], bits: int | tuple[int, int], window: int | None = None, split=contract_split,
              table_from_first_kept: bool = False, seed: int = 0, table_padding: int = 2) -> tuple[dict, torch.Tensor]:
    """(kernel arguments, expected output). Every sequence gets random exact K/V; keys of
    tokens < nk are quantised page by page per channel and values of tokens < nv per token,
    into randomly chosen pages of a pool; the other tokens go to rows t % RESIDUAL of the
    sequence's (random) slot of the residual rings. Unused pool slots and ring rows hold
    random bytes and NaN (so any read of a hidden slot shows). With a window, pages wholly
    before visible_from are released: -1 in a table that starts at logical page 0, or left
    out of a table that starts at the first kept page (`table_from_first_kept`). The
    expected output is `reference_attention` over the dequantised K/V (exact residual
    tokens) plus the step's own token. Random K/V do not depend on `bits` (one width, or
    the widths of the keys' and the values' codes)."""
    gen = torch.Generator().manual_seed(seed)
    garbage = torch.Generator().manual_seed(seed + 1)
    bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)
    per_byte = 8 // bits
    batch = len(lengths)
    num_pages, num_slots = sum(math.ceil(n / GROUP) for n in lengths) + 4, batch + 2
    nan = float("nan")
    k_codes = torch.randint(0, 256, (KV_HEADS, num_pages, DIM, GROUP // per_byte), generator=garbage,
                            dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (KV_HEADS, num_pages, GROUP, DIM * value_bits // 8), generator=garbage,
                            dtype=torch.uint8)
    k_scale, k_zero = (torch.full((KV_HEADS, num_pages, DIM), nan, dtype=torch.float16) for _ in range(2))
    v_scale, v_zero = (torch.full((KV_HEADS, num_pages, GROUP, DIM // GROUP), nan, dtype=torch.float16)
                       for _ in range(2))
    k_residual, v_residual = (torch.full((num_slots, KV_HEADS, RESIDUAL, DIM), nan) for _ in range(2))
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    q = torch.randn(batch, KV_HEADS * QUERY_GROUP, DIM, generator=gen)
    k_self = torch.randn(batch, KV_HEADS, DIM, generator=gen)
    v_self = torch.randn(batch, KV_HEADS, DIM, generator=gen)
    free_pages = torch.randperm(num_pages, generator=gen).tolist()
    splits = [split(n) for n in lengths]
    tables, first_positions, visible_from, expected = [], [], [], []
    for b, (n, (nk, nv)) in enumerate(zip(lengths, splits)):
        assert 0 <= n - nk <= RESIDUAL and 0 <= n - nv <= RESIDUAL
        start = 0 if window is None else max(0, n - window + 1)
        # keys for whole pages: a page holding token nk - 1 is quantised over all its tokens
        keys = torch.randn(math.ceil(n / GROUP) * GROUP, KV_HEADS, DIM, generator=gen)
        values = torch.randn(n, KV_HEADS, DIM, generator=gen)
        pages = {j: free_pages.pop() for j in range(start // GROUP, math.ceil(n / GROUP))}  # logical -> id
        k_seen, v_seen = keys.clone(), values.clone()
        for j in range(start // GROUP, math.ceil(nk / GROUP)):  # keys: per channel over the page's tokens
            tokens = slice(j * GROUP, (j + 1) * GROUP)
            quantised = quantize(keys[tokens].permute(1, 2, 0), bits, GROUP)  # [H, D, GROUP]
            k_codes[:, pages[j]], k_scale[:, pages[j]], k_zero[:, pages[j]] = (
                quantised.packed, quantised.scale[..., 0], quantised.zero[..., 0])
            k_seen[tokens] = dequantize(quantised).permute(2, 0, 1)
        k_seen[nk:] = keys[nk:]  # (from the ring)
        if nv:  # values: per token over groups of GROUP channels
            quantised = quantize(values[:nv], value_bits, GROUP)
            v_seen[:nv] = dequantize(quantised)
            for t in range(start // GROUP * GROUP, nv):
                page, offset = pages[t // GROUP], t % GROUP
                v_codes[:, page, offset] = quantised.packed[t]
                v_scale[:, page, offset], v_zero[:, page, offset] = quantised.scale[t], quantised.zero[t]
        for t in range(nk, n):
            k_residual[slots[b], :, t % RESIDUAL] = keys[t]
        for t in range(nv, n):
            v_residual[slots[b], :, t % RESIDUAL] = values[t]
        first_page = start // GROUP if table_from_first_kept else 0
        tables.append([pages.get(j, -1) for j in range(first_page, math.ceil(n / GROUP))])
        first_positions.append(first_page * GROUP)
        visible_from.append(start)
        k_all = torch.cat((k_seen[start:n], k_self[b:b + 1]))
        v_all = torch.cat((v_seen[start:], v_self[b:b + 1]))
        positions = torch.arange(start, n + 1)
        expected.append(reference_attention(q[b:b + 1], k_all, v_all, torch.tensor([n]), positions,
                                            DIM ** -0.5, None))
    width = max(len(t) for t in tables) + table_padding
    padding = [free_pages[0]] + [-1] * width  # an unused (garbage) page, then -1
    page_table = torch.tensor([t + padding[:width - len(t)] for t in tables])
    case = dict(q=q, k_self=k_self, v_self=v_self, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero,
                v_codes=v_codes, v_scale=v_scale, v_zero=v_zero, k_residual=k_residual, v_residual=v_residual,
                slots=slots, page_table=page_table, first_page_position=torch.tensor(first_positions),
                nk=torch.tensor([s[0] for s in splits]), nv=torch.tensor([s[1] for s in splits]),
                visible_from=torch.tensor(visible_from), n=torch.tensor(lengths), scale=DIM ** -0.5, bits=bits,
                group=GROUP)
    if value_bits != bits:
        case["value_bits"] = value_bits
    return case, torch.cat(expected)


CASES = [
    pytest.param(dict(window=None, split=contract_split), id="global"),
    pytest.param(dict(window=50, split=contract_split, table_from_first_kept=True), id="window50"),
    pytest.param(dict(window=21, split=free_split), id="window21-free-split"),
    pytest.param(dict(window=50, split=ragged_split), id="window50-ragged-split"),
]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("options", CASES)
def test_reference_equals_attention_over_dequantised_kv(bits: int, options: dict) -> None:
    case, expected = make_case(LENGTHS, bits, **options)
    out = kivi_decode_attention_reference(**case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cases_exercise_every_source() -> None:
    """Guards the test data: quantised and residual tokens of both kinds are visible,
    nk != nv and nv > nk occur, residual rings wrap, and windows hide pages both ways."""
    case, _ = make_case(LENGTHS, 2, window=50, table_from_first_kept=True)
    nk, nv, n, start = case["nk"], case["nv"], case["n"], case["visible_from"]
    assert ((nk > start) & (nk < n)).any() and ((nv > start) & (nv < n)).any()
    assert (nk != nv).any() and (start > 0).any() and (case["first_page_position"] > 0).any()
    assert ((nv % RESIDUAL) + (n - nv) > RESIDUAL).any()  # a value window wraps around its ring
    free, _ = make_case(LENGTHS, 2, window=21, split=free_split)
    assert (free["nv"] > free["nk"]).any() and (free["page_table"] == -1).any()


def test_reference_is_not_the_exact_attention() -> None:
    """The quantised tokens matter: the same K/V give different outputs at 2 and 8 bits, so
    the parity above is not vacuous."""
    split = lambda n: (n, n)  # noqa: E731  everything quantised
    outputs, expected = {}, {}
    for bits in (2, 8):
        case, expected[bits] = make_case([128], bits, split=split)
        outputs[bits] = kivi_decode_attention_reference(**case)
        torch.testing.assert_close(outputs[bits], expected[bits], rtol=1e-5, atol=1e-5)
    assert (outputs[2] - outputs[8]).abs().max() > 1e-2


@pytest.fixture
def triton_device() -> str:
    return triton_test_device()


def on(case: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("options", CASES)
def test_triton_kernel_matches_reference(triton_device: str, bits: int, options: dict) -> None:
    case, _ = make_case(LENGTHS, bits, **options)
    expected = kivi_decode_attention_reference(**case)
    out = kivi_decode_attention_triton(**on(case, triton_device)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [(4, 2), (2, 4), (8, 2)], ids=["k4v2", "k2v4", "k8v2"])
@pytest.mark.parametrize("options", CASES)
def test_triton_kernel_matches_reference_with_key_and_value_bits_apart(triton_device: str, bits: tuple[int, int],
                                                                       options: dict) -> None:
    """Keys and values in codes of different widths (the `quality2` preset: 4-bit keys, 2-bit
    values): the reference dequantises each with its own, and so must the kernel."""
    case, expected = make_case(LENGTHS, bits, **options)
    reference = kivi_decode_attention_reference(**case)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    out = kivi_decode_attention_triton(**on(case, triton_device), splits=2).cpu()
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


OTHER_GROUPS = [(12, 48, 2), (12, 48, 4), (64, 64, 2), (64, 64, 4), (4, 32, 2), (4, 32, 4), (16, 48, 2), (16, 48, 4),
                (8, 24, 8), (1, 16, 8)]


@pytest.mark.parametrize("group, dim, bits", [pytest.param(*g, id="group{}-dim{}-{}bit".format(*g)) for g in OTHER_GROUPS])
@pytest.mark.parametrize("options", CASES)
def test_triton_kernel_matches_reference_at_other_groups(triton_device: str, monkeypatch, bits: int, group: int,
                                                         dim: int, options: dict) -> None:
    """Tiles are 32 tokens in parts that each lie in one page: a group of 12 (not a power of
    two: parts of 4 tokens, each channel gathering its value scale, head_dim padded to 64),
    a group of 64 (two tiles per page, reading from the middle of a channel's codes), groups
    of 4 and 1 (eight and 32 pages per tile), and head_dims of 48 and 24 (padded to 64 and
    32: a token's padded value scales and code bytes are masked)."""
    module = sys.modules[__name__]
    for name, value in (("GROUP", group), ("DIM", dim), ("RESIDUAL", 2 * group if group > 16 else 48)):
        monkeypatch.setattr(module, name, value)
    case, _ = make_case(LENGTHS, bits, **options)
    expected = kivi_decode_attention_reference(**case)
    out = kivi_decode_attention_triton(**on(case, triton_device), splits=2).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_the_decode_warps_knob_reaches_the_launch(triton_device: str, monkeypatch) -> None:
    """KVFORGE_TRITON_DECODE_WARPS sets the kernel's warps per program; the output is the same."""
    from kvforge.kernels.triton_runtime import DECODE_WARPS_ENV

    warps = warps_of_launches(monkeypatch, triton_decode, "_kivi_decode_kernel")
    monkeypatch.setenv(DECODE_WARPS_ENV, "8")
    case, _ = make_case(LENGTHS, 2, **CASES[0].values[0])
    out = kivi_decode_attention_triton(**on(case, triton_device), splits=1).cpu()
    torch.testing.assert_close(out, kivi_decode_attention_reference(**case), rtol=1e-4, atol=1e-4)
    assert warps == [8]


@pytest.mark.parametrize("splits", [1, 2, 3, 6])
@pytest.mark.parametrize("options", CASES)
def test_split_k_matches_reference(triton_device: str, splits: int, options: dict) -> None:
    """Every sequence's token range cut into parts run by separate programs and combined;
    tables without padding columns make the split bound tight. Six parts are one 32-token
    tile each: most parts of the short sequences are empty."""
    case, _ = make_case(LENGTHS, 2, table_padding=0, **options)
    expected = kivi_decode_attention_reference(**case)
    out = kivi_decode_attention_triton(**on(case, triton_device), splits=splits).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_splits_cover_the_aligned_first_tile(triton_device: str) -> None:
    """Tiles start at multiples of 32 tokens, so a sequence whose window starts mid-tile
    spans up to 31 tokens more than its table and ring hold. Here: 144 tokens, visible from
    48 (tiles from 32), keys and values quantised below 112 in a table of the four pages
    48..111 (the pages of ring tokens are absent, as the contract allows) and a full ring of
    32: 96 tokens of bound, 112 to walk; one split of 96 would miss the last 16."""
    case, _ = make_case([144], 2, window=97, split=lambda n: (112, 112), table_from_first_kept=True,
                        table_padding=0)
    assert case["visible_from"].tolist() == [48] and case["page_table"].shape[1] > 4
    case["page_table"] = case["page_table"][:, :4].contiguous()
    expected = kivi_decode_attention_reference(**case)
    out = kivi_decode_attention_triton(**on(case, triton_device), splits=1).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_split_count_fills_the_device_and_keeps_splits_long() -> None:
    h100 = torch.device("cuda", 0)
    triton_decode._SM_COUNTS[0] = 132
    try:
        # 16 sequences x 3 KV heads at 2,048 tokens: 4 x 132 programs wanted -> 11 splits
        assert triton_decode.choose_splits(48, 2048 + 128, h100) == 11
        # short contexts: each split keeps MIN_SPLIT_TILES tiles of BLOCK_T tokens
        assert triton_decode.choose_splits(48, 300, h100) == 300 // (4 * triton_decode.BLOCK_T)
        assert triton_decode.choose_splits(48, 50, h100) == 1
        assert triton_decode.choose_splits(1024, 32768, h100) == 1  # enough pairs already
        assert triton_decode.choose_splits(1, 65536, h100) == triton_decode.MAX_SPLITS
    finally:
        del triton_decode._SM_COUNTS[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_kernel_half_precision_compute_dtype(triton_device: str, dtype: torch.dtype) -> None:
    """Queries, own K/V and residuals in the compute dtype; both paths accumulate in float32,
    so they differ by the final rounding to `dtype` at most."""
    case, _ = make_case(LENGTHS, 4, window=50)
    for name in ("q", "k_self", "v_self", "k_residual", "v_residual"):
        case[name] = case[name].to(dtype)
    expected = kivi_decode_attention_reference(**case)
    out = kivi_decode_attention_triton(**on(case, triton_device)).cpu()
    assert out.dtype == dtype
    tolerance = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_triton_kernel_reads_views_of_a_multi_layer_store(triton_device: str) -> None:
    """The cache passes views of multi-layer stores and of wider residual buffers; the
    kernel must honour their strides instead of assuming contiguity."""
    case, _ = make_case([40, 77], 4, window=50)
    expected = kivi_decode_attention_reference(**case)
    strided = dict(case)
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        heads, rest = case[name].shape[0], case[name].shape[1:]
        layers = torch.zeros((heads, 3, *rest), dtype=case[name].dtype)  # layer axis inside
        layers[:, 1] = case[name]
        strided[name] = layers[:, 1]
    for name in ("k_residual", "v_residual"):  # residual rows inside a wider buffer
        wide = torch.zeros((*case[name].shape[:2], case[name].shape[2] + 5, DIM))
        wide[:, :, :case[name].shape[2]] = case[name]
        strided[name] = wide[:, :, :case[name].shape[2]]
    out = kivi_decode_attention_triton(**on(strided, triton_device)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_triton_launcher_rejects_bad_arguments(triton_device: str) -> None:
    case, _ = make_case([40], 2)
    with pytest.raises(ConfigError, match="bits"):
        kivi_decode_attention_triton(**on({**case, "bits": 3}, triton_device))
    with pytest.raises(ConfigError, match="k_codes"):
        kivi_decode_attention_triton(**on({**case, "bits": 4}, triton_device))
    loose = case["v_codes"].transpose(2, 3).contiguous().transpose(2, 3)  # a page's tokens not contiguous
    with pytest.raises(ConfigError, match="quantised store.*v_codes"):
        kivi_decode_attention_triton(**on({**case, "v_codes": loose}, triton_device))


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available(),
                    reason="needs the `triton` package and no CUDA (with CUDA the tests above run compiled)")
def test_without_a_gpu_the_kernel_tests_run_interpreted() -> None:
    """tests/conftest.py loads the kernel in Triton's interpreter, so the tests above run in
    `make test` instead of skipping (unless the caller turned it off with TRITON_INTERPRET=0)."""
    if os.environ.get("TRITON_INTERPRET") == "0":
        pytest.skip("TRITON_INTERPRET=0 was set: the interpreter is off on purpose")
    assert triton_interpreted()


def test_interpreter_check_works_with_and_without_triton_knobs(monkeypatch) -> None:
    """`triton.knobs` is recent; an older Triton is asked through TRITON_INTERPRET instead."""
    from types import SimpleNamespace

    monkeypatch.setattr(triton_jit, "triton", SimpleNamespace())  # a Triton without knobs
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_interpreting()
    runtime = SimpleNamespace(interpret=True)
    monkeypatch.setattr(triton_jit, "triton", SimpleNamespace(knobs=SimpleNamespace(runtime=runtime)))
    assert triton_interpreting()  # the knob wins over the environment when it exists
    monkeypatch.setattr(triton_jit, "triton", None)
    assert not triton_interpreting()


@pytest.mark.skipif(not triton_available() or torch.cuda.device_count() < 2, reason="needs triton and two GPUs")
def test_triton_kernel_runs_on_the_device_of_its_tensors() -> None:
    """Tensors on cuda:1 while cuda:0 is current: the launch follows the tensors."""
    case, _ = make_case(LENGTHS, 4)
    expected = kivi_decode_attention_reference(**case)
    with torch.cuda.device(0):
        out = kivi_decode_attention_triton(**on(case, "cuda:1"))
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(triton_available(), reason="checks the behaviour without the `triton` package")
def test_triton_launcher_without_triton_raises() -> None:
    case, _ = make_case([40], 2)
    with pytest.raises(RuntimeError, match="triton"):
        kivi_decode_attention_triton(**case)
