"""The bf16 dot path of the CPU paged decode attention (bf16 q over bf16 pages, AVX512-BF16)
against the float64 definition of attention and against the widening float path.

Its precision is that of ATen's bf16 flash attention: exact bf16 products summed in float32,
float32 softmax, weights rounded to bf16 once (cpu_bf16_attention.h). Measured on random
cases, its mean error against float64 is about 1.4x the float path's (whose weights stay
float32); both are dominated by the bf16 rounding of the output. The bounds below are 2x.
"""

from __future__ import annotations

import pytest
import torch
from decode_cases import make_case

from kvforge.cache.attention import decode_attention
from kvforge.cache.full.cpu_decode import bf16_dot, bf16_dot_supported, paged_decode_attention_cpu

pytestmark = pytest.mark.skipif(not bf16_dot_supported(),
                                reason="no AVX512-BF16 in this build (or the CPU kernel is unavailable)")

INPUTS = ("q", "k_self", "v_self", "k_pages", "v_pages")


def bf16_case(lengths: list[int], kv_heads: int, group: int, dim: int, window: int | None = None,
              block: int = 16) -> dict:
    case = make_case(lengths, kv_heads, group, dim, block=block, storage=torch.bfloat16, window=window)
    for key in ("q", "k_self", "v_self"):
        case[key] = case[key].to(torch.bfloat16)
    return case


def errors(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dot path output, float path output, float64 definition) for one case."""
    with bf16_dot(True):
        dot = paged_decode_attention_cpu(**case)
    with bf16_dot(False):
        widening = paged_decode_attention_cpu(**case)
    exact = decode_attention(**{**case, **{key: case[key].double() for key in INPUTS}}, tile_pages=4)
    return dot.double(), widening.double(), exact


def assert_as_close_as_float_path(case: dict) -> None:
    dot, widening, exact = errors(case)
    assert not torch.equal(dot, widening)  # the dot path ran: its weights round differently
    dot_error, float_error = (dot - exact).abs(), (widening - exact).abs()
    assert dot_error.mean() <= 2 * float_error.mean() + 1e-7, (dot_error.mean(), float_error.mean())
    # per element: bf16 output rounding (2^-8 relative) plus weight rounding, with margin
    assert (dot_error <= 2e-2 * exact.abs() + 2e-3).all(), dot_error.max()


# groups up to 4 in one pass, 6 and 8 in two (4 + 2, 4 + 4); the 1500-row sequence is
# split into several units, the later ones without the own token
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (1, 4), (2, 6), (1, 8)])
@pytest.mark.parametrize("lengths", [[1, 17, 90, 401], [1500]], ids=["b4", "b1-split"])
def test_dot_path_as_close_to_the_definition_as_the_float_path(lengths, kv_heads, group, dim):
    assert_as_close_as_float_path(bf16_case(lengths, kv_heads, group, dim))


@pytest.mark.parametrize("window", [13, 64, 100])  # (window 1: the own token only, tested below)
def test_dot_path_sliding_window(window):
    case = bf16_case([3, 20, 41, 200, 777], kv_heads=2, group=3, dim=64, window=window, block=4)
    assert (case["visible_from"] > case["first_page_position"]).any()
    assert_as_close_as_float_path(case)


def test_dot_path_online_rescale():
    """Keys grow along the sequence, so every tile raises the running max and the
    accumulators are rescaled each time; scores up to ~60 make a missed rescale visible."""
    case = bf16_case([700], kv_heads=1, group=3, dim=64)
    positions = torch.arange(case["k_pages"].shape[1] * case["k_pages"].shape[2])
    growth = (1 + positions / 100).reshape(case["k_pages"].shape[1], case["k_pages"].shape[2], 1)
    case["k_pages"] = (case["k_pages"].float() * growth).to(torch.bfloat16)
    case["q"] = (case["q"].float() * 2).to(torch.bfloat16)
    dot, _, exact = errors(case)
    assert (dot - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_dot_path_own_token_only():
    """No stored rows: the own token's value comes back (weight exactly 1)."""
    case = bf16_case([0, 0], kv_heads=1, group=4, dim=128)
    with bf16_dot(True):
        out = paged_decode_attention_cpu(**case)
    assert torch.equal(out, case["v_self"].repeat_interleave(4, dim=1))


def test_dot_path_declines_other_dtypes_and_dims():
    """float32 queries, float16 pages and a head dim of 32 take the float path: identical
    results with the dot path on and off."""
    cases = [make_case([5, 70], kv_heads=1, group=3, dim=64, storage=torch.bfloat16),  # float32 q
             bf16_case([5, 70], kv_heads=1, group=3, dim=32)]
    half = make_case([5, 70], kv_heads=1, group=3, dim=64, storage=torch.float16)
    cases.append({**half, **{key: half[key].to(torch.float16) for key in ("q", "k_self", "v_self")}})
    for case in cases:
        with bf16_dot(True):
            on = paged_decode_attention_cpu(**case)
        with bf16_dot(False):
            off = paged_decode_attention_cpu(**case)
        assert torch.equal(on, off)


def test_toggle_restores_the_previous_setting():
    with bf16_dot(False):
        with bf16_dot(True):
            pass
        assert torch.ops.kvforge_cpu.set_bf16_dot(False) is False  # still off after the inner block
    assert torch.ops.kvforge_cpu.set_bf16_dot(True) is True  # on again after the outer one
