"""The paged Triton decode kernel of the `full` cache against the tiled PyTorch
`decode_attention` (on CUDA, or in Triton's CPU interpreter, which tests/conftest.py turns on
without a GPU; skipped, with the reason, without the `triton` package), and the cache
choosing it (`decode_kernel=triton`, `auto` on CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from decode_cases import make_case
from triton_helpers import kernel_device, warps_of_launches

from kvforge.cache.attention import decode_attention
from kvforge.cache.full import decode_kernels
from kvforge.cache.full.decode_kernels import resolve_decode_kernel
from kvforge.cache.registry import parse_cache_spec
from kvforge.errors import ConfigError


def run(case: dict, dtype: torch.dtype = torch.float32, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output on the test device, tiled reference on the CPU) with q/k_self/v_self in `dtype`."""
    device = kernel_device()
    from kvforge.cache.full.triton_decode import paged_decode_attention_triton

    case = {**case, **{key: case[key].to(dtype) for key in ("q", "k_self", "v_self")}}
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = paged_decode_attention_triton(**on_device, splits=splits).cpu()
    return out, decode_attention(**case, tile_pages=2)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 4), (2, 3)])
def test_matches_the_tiled_path(dtype, kv_heads, group):
    case = make_case([0, 5, 37, 70], kv_heads, group, dim=32, block=4, storage=dtype)
    out, ref = run(case, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_block_sizes(block):
    """Tiles are tokens, not pages: blocks smaller, larger and not a divisor of BLOCK_T."""
    out, ref = run(make_case([3, 40, 97], kv_heads=2, group=2, dim=16, block=block))
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("window", [1, 6, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window, dtype):
    """Tables start at the page holding the window's first token (first_page_position > 0)
    and visible_from falls inside that page."""
    case = make_case([3, 20, 41, 90], kv_heads=2, group=3, dim=32, block=4, storage=dtype, window=window)
    assert (case["visible_from"] > case["first_page_position"]).any()
    out, ref = run(case, dtype)
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_counts_agree(splits):
    case = make_case([1, 50, 180], kv_heads=2, group=2, dim=32, block=8)
    out, ref = run(case, splits=splits)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_padding_rows_and_hidden_slots_are_never_read():
    """A CUDA-graph bucket's shape: the table padded to a fixed width with -1 (an invalid page
    id), padding rows with nothing stored (visible_to == visible_from, at 0 and mid-sequence)
    and every hidden slot of the storage NaN: each padding row attends only to its own token,
    and the real rows are what the clean, compact inputs give."""
    case = make_case([9, 30, 2, 0, 0], kv_heads=2, group=2, dim=16, block=4, window=7, padding=0)
    case["visible_from"][4] = case["visible_to"][4] = 20  # a padding row at a later position
    case["first_page_position"][4] = 16
    reference = decode_attention(**case, tile_pages=2)
    block = case["k_pages"].shape[2]
    first, start, stop = (case[key].tolist() for key in ("first_page_position", "visible_from", "visible_to"))
    visible: set[tuple[int, int]] = set()
    width = case["page_table"].shape[1] + 3
    padded = torch.full((5, width), -1, dtype=torch.long)
    for row, ids in enumerate(case["page_table"].tolist()):
        for column, page in enumerate(ids):
            seen = [slot for slot in range(block) if start[row] <= first[row] + column * block + slot < stop[row]]
            visible.update((page, slot) for slot in seen)
            if seen:
                padded[row, column] = page
    for side in ("k_pages", "v_pages"):
        poisoned = case[side].clone()
        for page in range(poisoned.shape[1]):
            for slot in range(block):
                if (page, slot) not in visible:
                    poisoned[:, page, slot] = float("nan")
        case[side] = poisoned
    case["page_table"] = padded
    assert (padded == -1).sum() > 5
    out = run_padded(case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[3:], case["v_self"][3:].repeat_interleave(2, dim=1), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, reference, **tolerance(torch.float32))


def run_padded(case: dict) -> torch.Tensor:
    """The kernel alone (the tiled reference cannot read -1 page ids)."""
    device = kernel_device()
    from kvforge.cache.full.triton_decode import paged_decode_attention_triton

    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    return paged_decode_attention_triton(**on_device).cpu()


def test_splits_come_from_shapes_only():
    from kvforge.cache.full.triton_decode import BLOCK_T, MAX_SPLITS, MIN_SPLIT_TILES, choose_splits

    kernel_device()
    cpu = torch.device("cpu")
    assert choose_splits(pairs=64, bound=4096, device=cpu) == 1
    assert choose_splits(pairs=1, bound=MIN_SPLIT_TILES * BLOCK_T, device=cpu) == 1
    assert 1 < choose_splits(pairs=1, bound=1 << 20, device=cpu) <= MAX_SPLITS


def test_the_cache_resolves_its_kernel(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_decode_kernel("auto", cpu, fp8_pages=False) == "auto"
    assert resolve_decode_kernel("auto", cuda, fp8_pages=True) == "auto"
    assert resolve_decode_kernel("gather", cuda, fp8_pages=False) == "gather"
    with pytest.raises(ConfigError, match="16/32-bit pages"):
        resolve_decode_kernel("triton", cuda, fp8_pages=True)
    with pytest.raises(ConfigError, match="not meta"):
        resolve_decode_kernel("triton", torch.device("meta"), fp8_pages=False)
    assert parse_cache_spec("full:decode_kernel=triton").config().decode_kernel == "triton"
    monkeypatch.setattr(decode_kernels, "triton_installed", lambda: False)
    assert resolve_decode_kernel("auto", cuda, fp8_pages=False) == "auto"
    with pytest.raises(ConfigError, match="not installed"):
        resolve_decode_kernel("triton", cuda, fp8_pages=False)
    monkeypatch.setattr(decode_kernels, "triton_installed", lambda: True)
    assert resolve_decode_kernel("auto", cuda, fp8_pages=False) == "triton"


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
def test_model_decode_same_logits_through_the_triton_kernel(name, monkeypatch):
    """`decode_kernel=triton` through the engine (prefill, then batched decode, GQA and a
    sliding window) gives the tiled path's logits, and the kernel is what ran."""
    if kernel_device() != "cpu":
        pytest.skip("the engine test runs the interpreter on the CPU")
    from kvforge.cache.full import triton_decode

    calls = []
    kernel = triton_decode.paged_decode_attention_triton
    monkeypatch.setattr(triton_decode, "paged_decode_attention_triton",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    _, model = make_pair(name)
    prompts = [list(range(3, 30)), [7, 8], list(range(40, 52))]
    logits = {kernel: decode_logits(make_runner(model, cache=f"full:block_size=4,decode_kernel={kernel}"),
                                    prompts, steps=6) for kernel in ("triton", "torch")}
    assert calls, "decode_kernel=triton did not run the Triton kernel"
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("warps", [None, "8"])
def test_the_decode_warps_knob_reaches_the_launch(monkeypatch, warps):
    """KVFORGE_TRITON_DECODE_WARPS sets the warps per program of the decode kernels (4
    unset); the output is the same either way (on CUDA compiled at that count)."""
    kernel_device()
    from kvforge.cache.full import triton_decode
    from kvforge.kernels.triton_jit import DECODE_WARPS_ENV

    launched = warps_of_launches(monkeypatch, triton_decode, "_paged_decode_kernel")
    if warps is None:
        monkeypatch.delenv(DECODE_WARPS_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_WARPS_ENV, warps)
    out, ref = run(make_case([0, 5, 37], 2, 2, dim=32, block=4, storage=torch.float32), splits=1)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    assert launched == [int(warps or 4)]


def test_a_bad_decode_warps_value_names_the_variable(monkeypatch):
    kernel_device()
    from kvforge.kernels.triton_jit import DECODE_WARPS_ENV, decode_warps

    monkeypatch.setenv(DECODE_WARPS_ENV, "6")
    with pytest.raises(ConfigError, match="KVFORGE_TRITON_DECODE_WARPS.*'6'.*must be one of 1, 2, 4, 8, 16"):
        decode_warps()
