"""Group quantisation and bit packing (kvforge.cache.kivi.quant).

The definitional tests run on both implementations: `quantize` (the compiled CPU kernel
where it builds) and `quantize_reference` (the PyTorch definition); parity between the two
is tests/cache/kivi/test_kivi_cpu_quant.py."""

import pytest
import torch

from kvforge.cache.kivi.quant import (
    SUPPORTED_BITS,
    dequantize,
    pack_codes,
    quantize,
    quantize_reference,
    quantized_bits_per_element,
    unpack_codes,
)
from kvforge.errors import ConfigError

both_implementations = pytest.mark.parametrize("quantise", [quantize, quantize_reference],
                                               ids=["quantize", "reference"])


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_unpack_round_trip(bits):
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 7, 64), generator=generator).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 7, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_packing_layout_is_low_bits_first():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [[1 | (2 << 2) | (3 << 4)]]
    assert pack_codes(torch.tensor([[5, 12]], dtype=torch.uint8), 4).tolist() == [[5 | (12 << 4)]]


@both_implementations
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group", [8, 32, 64])
def test_dequantisation_error_is_within_half_a_step(quantise, bits, group):
    generator = torch.Generator().manual_seed(group)
    # Mixed magnitudes, like keys with outlier channels.
    x = torch.randn(4, 6, 128, generator=generator) * torch.logspace(-2, 1, 128)
    q = quantise(x, bits, group)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    error = (dequantize(q) - x).abs().reshape(4, 6, 128 // group, group)
    bound = q.scale.float().unsqueeze(-1) / 2
    assert bool((error <= bound * (1 + 1e-5) + 1e-6).all())


@both_implementations
def test_constant_groups_are_exact(quantise):
    x = torch.full((2, 64), 0.37)
    assert torch.allclose(dequantize(quantise(x, 2, 32)), x, atol=1e-3)
    zeros = torch.zeros(2, 64)
    assert torch.equal(dequantize(quantise(zeros, 4, 32)), zeros)


@both_implementations
def test_codes_span_the_range(quantise):
    x = torch.linspace(-1, 1, 32).reshape(1, 32)
    codes = unpack_codes(quantise(x, 2, 32).packed, 2)
    assert codes.min().item() == 0 and codes.max().item() == 3


def test_storage_cost_matches_the_analytic_bits():
    x = torch.randn(8, 256)
    for bits in SUPPORTED_BITS:
        q = quantize(x, bits, 32)
        assert q.nbytes() * 8 / x.numel() == quantized_bits_per_element(bits, 32)
    assert quantized_bits_per_element(2, 32) / 16 == pytest.approx(0.1875)


def test_bad_parameters_name_the_rule():
    with pytest.raises(ConfigError, match="bits"):
        quantize(torch.randn(2, 32), 3, 32)
    with pytest.raises(ConfigError, match="group"):
        quantize(torch.randn(2, 48), 2, 32)
