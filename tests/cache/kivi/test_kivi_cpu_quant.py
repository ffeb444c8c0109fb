"""The compiled KIVI quantisation (cache/kivi/cpu_quant.py) against its PyTorch definition,
`quant.quantize_reference`: the same codes, scales and zero points, bit for bit."""

import pytest
import torch

from kvforge.cache.kivi import cpu_quant
from kvforge.cache.kivi.quant import (
    SUPPORTED_BITS,
    QuantizedGroups,
    quantize,
    quantize_reference,
    unpack_codes,
)
from kvforge.kernels.build import DISABLE_ENV

requires_kernel = pytest.mark.skipif(not cpu_quant.quantize_kernel_available(),
                                     reason="the KIVI quantisation kernel did not build here")


def assert_identical(a: QuantizedGroups, b: QuantizedGroups) -> None:
    assert a.packed.dtype == b.packed.dtype == torch.uint8
    assert a.scale.dtype == b.scale.dtype == a.zero.dtype == b.zero.dtype == torch.float16
    assert torch.equal(a.packed, b.packed)
    # bits, not values: a float16 rounded the other way, or a zero of the other sign, differs here
    assert torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))
    assert torch.equal(a.zero.view(torch.int16), b.zero.view(torch.int16))


def mixed_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes over seven decades (outlier channels), so that float16 zero points and
    scales land on both sides of their targets, plus a constant group whose value float16
    holds exactly (zero point equal to it, scale 0)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.logspace(-4, 3, shape[-1])
    x[..., :8] = 0.375
    return x.to(dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group", [8, 32, 128])
def test_kernel_equals_the_reference_bit_for_bit(dtype, bits, group):
    x = mixed_input((3, 5, 256), dtype, seed=bits * 1000 + group)
    fast = quantize(x, bits, group)
    assert_identical(fast, quantize_reference(x, bits, group))
    assert fast.packed.shape == (3, 5, 256 * bits // 8) and fast.scale.shape == (3, 5, 256 // group)


@requires_kernel
def test_the_kernel_runs_and_reads_strided_views():
    # KIVI's keys are quantised per channel through a transposed view of the tokens.
    keys = mixed_input((64, 3, 32), torch.bfloat16, seed=7)  # [tokens, heads, dim]
    per_channel = keys.reshape(2, 32, 3, 32).movedim(-2, -4).transpose(-1, -2)  # [H, pages, D, G]
    assert not per_channel.is_contiguous()
    out = cpu_quant.quantize_groups(per_channel, 2, 32)
    assert out is not None, "eligible input must take the kernel"
    assert_identical(QuantizedGroups(*out, 2, 32), quantize_reference(per_channel, 2, 32))


def test_ineligible_inputs_take_the_reference(monkeypatch):
    x = mixed_input((4, 64), torch.float32, seed=3)
    assert cpu_quant.quantize_groups(x.double(), 2, 32) is None
    needs_grad = x.clone().requires_grad_()
    assert cpu_quant.quantize_groups(needs_grad, 2, 32) is None
    assert_identical(quantize(needs_grad, 2, 32), quantize_reference(x, 2, 32))
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert cpu_quant.quantize_groups(x, 2, 32) is None
    assert_identical(quantize(x, 4, 32), quantize_reference(x, 4, 32))


@requires_kernel
def test_the_op_refuses_bad_arguments():
    op = torch.ops.kvforge_kivi_quant.quantize_groups
    with pytest.raises(RuntimeError, match="bits must be 2, 4 or 8"):
        op(torch.randn(2, 32), 3, 32)
    with pytest.raises(RuntimeError, match="must divide n"):
        op(torch.randn(2, 48), 2, 32)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(32, 2).t(), 2, 32)


@pytest.mark.parametrize("quantise", [quantize, quantize_reference], ids=["quantize", "reference"])
def test_ties_round_to_even(quantise):
    # zero 0 and scale 1 exactly (bits 2: levels 3), so (x - zero) / scale is x: the halves
    # 0.5, 1.5 and 2.5 go to 0, 2 and 2 (torch.round), not 1, 2 and 3 (half away from zero).
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 0.0]])
    codes = unpack_codes(quantise(x, 2, 8).packed, 2)
    assert codes.tolist() == [[0, 0, 2, 2, 3, 1, 2, 0]]
