"""The small-M linear's AMX-BF16 path (kernels/cpu_amx_linear.h), on CPUs that have AMX
(Sapphire Rapids and later; skipped elsewhere): float32 accumulation against the exact
product, M-invariance across its x blocks (M > 16, M > 32), the shape rule that picks it,
products of mixed paths in one call, and the bf16 rounding of its outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu_linear import small_m_linear_available

pytestmark = pytest.mark.skipif(
    not small_m_linear_available() or not torch.ops.kvforge_cpu_linear.amx_supported(),
    reason="no AMX-BF16 on this CPU (or the kernel could not be built)")


def ops():
    return torch.ops.kvforge_cpu_linear


class amx_switch:
    """Sets the process-wide AMX switch for a block and restores it afterwards."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        self.previous = ops().set_amx(self.enabled)

    def __exit__(self, *exc: object) -> None:
        ops().set_amx(self.previous)


def bf16_operands(m: int, k: int, n: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    return x, weight, (torch.randn(n, generator=gen).bfloat16() if bias else None)


def exact(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (576, 192), (32, 16), (64, 48), (640, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_accumulates_in_float32(k, n, bias):
    """Exact bf16 products summed in float32, one rounding to bf16 at the end: within half a
    unit in the last place plus the float32 sums' error, and nearly always the correctly
    rounded value (the same contract as the AVX512-BF16 path)."""
    for m in (1, 3, 16, 17, 32, 40):
        x, weight, b = bf16_operands(m, k, n, bias, seed=m)
        out = ops().small_m_linear(x, weight, b)
        reference = exact(x, weight, b)
        scale = (x.abs().double() @ weight.abs().double().T).max().item() + 1.0
        torch.testing.assert_close(out.double(), reference, atol=1e-5 * scale, rtol=2 * 2 ** -8)
        assert (out == reference.to(torch.bfloat16)).float().mean().item() > 0.98


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n", [(576, 1536), (64, 48)])
def test_rows_do_not_depend_on_the_batch(threads, k, n):
    """A row's result is bitwise the same alone, at any position of a batch of any size (one
    x block, two, or more than two: M > 32 takes a second pass over each W unit), and with
    any thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weight, bias = bf16_operands(48, k, n, bias=True)
        full = ops().small_m_linear(x, weight, bias)
        for i in range(48):
            assert torch.equal(ops().small_m_linear(x[i:i + 1], weight, bias)[0], full[i]), f"row {i}"
        gen = torch.Generator().manual_seed(3)
        for m in (2, 15, 16, 17, 31, 33, 45):
            rows = torch.randperm(48, generator=gen)[:m]
            other = torch.cat([torch.randn(3, k, generator=gen).bfloat16(), x[rows]])
            assert torch.equal(ops().small_m_linear(other, weight, bias)[3:], full[rows]), f"batch of {m + 3}"
    finally:
        torch.set_num_threads(previous)


def test_the_switch_picks_the_path():
    """With the switch on a fitting shape takes AMX, off it takes the AVX512-BF16 path: both
    are within the float32 contract, and they differ in the last bits somewhere (another
    summation order), which shows the switch really changes the path. set_amx returns the
    previous setting."""
    x, weight, bias = bf16_operands(16, 1536, 1536, bias=True)
    with amx_switch(True):
        tiled = ops().small_m_linear(x, weight, bias)
        assert ops().set_amx(True) is True
    with amx_switch(False):
        dot = ops().small_m_linear(x, weight, bias)
        assert ops().set_amx(False) is False
    assert not torch.equal(tiled, dot)
    reference = exact(x, weight, bias)
    scale = (x.abs().double() @ weight.abs().double().T).max().item() + 1.0
    for out in (tiled, dot):
        torch.testing.assert_close(out.double(), reference, atol=1e-5 * scale, rtol=2 * 2 ** -8)


@pytest.mark.parametrize("k,n", [(576, 100), (40, 64), (576, 8)])
def test_shapes_that_do_not_fit_take_the_dot_path(k, n):
    """AMX needs K % 32 == 0 and N % 16 == 0; any other shape gives exactly the AVX512-BF16
    path's bits, switch on or off (the rule depends on the shape only, never on M)."""
    x, weight, bias = bf16_operands(17, k, n, bias=True)
    with amx_switch(False):
        dot = ops().small_m_linear(x, weight, bias)
    with amx_switch(True):
        assert torch.equal(ops().small_m_linear(x, weight, bias), dot)


@pytest.mark.parametrize("m", [1, 17, 40])
def test_mixed_products_equal_their_own_calls_bitwise(m):
    """small_m_linear_many with products on both paths (N = 48 and 64 fit, 37 does not):
    each output is bitwise what its own call gives."""
    gen = torch.Generator().manual_seed(m)
    k = 64
    x = torch.randn(m, k, generator=gen).bfloat16()
    shapes = [(48, True), (37, False), (64, False), (16, True)]
    weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16() for n, _ in shapes]
    biases = [torch.randn(n, generator=gen).bfloat16() if has else None for n, has in shapes]
    outs = ops().small_m_linear_many(x, weights, biases)
    for out, weight, bias in zip(outs, weights, biases):
        assert torch.equal(out, ops().small_m_linear(x, weight, bias))


@pytest.mark.parametrize("bias", [False, True])
def test_outputs_round_like_torch(bias):
    """Small integer operands make every float32 sum exact whatever its order, so the one
    rounding left is float32 -> bf16, which must be torch's own bit for bit (ties to even
    occur); a NaN output is c10::BFloat16's 0x7FC0 even from a NaN with its sign bit set."""
    gen = torch.Generator().manual_seed(7)
    n = 32
    for m in (1, 16, 20):
        x = torch.randint(-16, 17, (m, 64), generator=gen).to(torch.bfloat16)
        weight = torch.randint(-16, 17, (n, 64), generator=gen).to(torch.bfloat16)
        b = torch.randint(-300, 301, (n,), generator=gen).to(torch.bfloat16) if bias else None
        weight.view(torch.int16)[[1, 30], 5] = -64  # 0xFFC0: a NaN with its sign bit set
        reference = exact(x, weight, b).float()
        out = ops().small_m_linear(x, weight, b)
        expected = reference.to(torch.bfloat16)
        assert ((reference.view(torch.int32) & 0xFFFF) == 0x8000).any(), "the operands must produce ties"
        nan = expected.isnan()
        assert nan[:, [1, 30]].all() and nan.sum() == 2 * m
        assert torch.equal(out.view(torch.int16)[nan], torch.full((2 * m,), 0x7FC0, dtype=torch.int16))
        assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan]), f"m={m}"
