"""The small-M linear kernel against F.linear, its M-invariance (batched rows are bitwise
equal to single rows), the dispatch rules of `linear`, and a tiny model end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import decode_logits, make_pair, make_runner

from kvforge.kernels import cpu_linear
from kvforge.kernels.cpu_linear import MAX_ROWS, linear, small_m_linear_available

requires_kernel = pytest.mark.skipif(
    not small_m_linear_available(),
    reason="the small-M linear kernel could not be built (see the logged warning) or "
           "KVFORGE_DISABLE_CPU_KERNELS is set")


def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.kvforge_cpu_linear.small_m_linear(x, weight, bias)


def operands(m: int, k: int, n: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    return x, weight, (torch.randn(n, generator=gen) if bias else None)


def assert_matches_f_linear(x, weight, bias) -> None:
    out = kernel(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 accumulation of K terms: error relative to the magnitude of the terms
    scale = (x.abs().double() @ weight.abs().double().T).max().item() + 1.0
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4 * scale, rtol=0)


@requires_kernel
@pytest.mark.parametrize("k", [576, 1536, 64, 20, 1])
@pytest.mark.parametrize("n", [1, 7, 192, 1536])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(k, n, bias):
    for m in (1, 2, 5, 6, 7, 16, 17, 32):
        assert_matches_f_linear(*operands(m, k, n, bias, seed=m))


@requires_kernel
@pytest.mark.parametrize("m", range(1, 33))
def test_every_row_count(m):
    assert_matches_f_linear(*operands(m, 37, 13, bias=True, seed=m))


@requires_kernel
def test_lm_head_size():
    assert_matches_f_linear(*operands(16, 576, 49152, bias=False))


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefetch_distance_changes_no_result(dtype):
    """How far ahead W is prefetched (8 KiB by default: 2 tiles at K = 576 in bf16) is a
    speed setting only: every distance, including one past the end of a thread's range,
    gives the same bits; a negative one is refused with the parameter named."""
    set_distance = torch.ops.kvforge_cpu_linear.set_prefetch_bytes
    x, weight, bias = operands(16, 576, 203, bias=True)
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    previous = set_distance(0)
    try:
        reference = kernel(x, weight, bias)
        for distance in (1, 4608, 8192, 1 << 20, 1 << 40):
            set_distance(distance)
            for m in (1, 4, 16):
                assert torch.equal(kernel(x[:m], weight, bias), reference[:m]), (distance, m)
        with pytest.raises(RuntimeError, match="bytes must be >= 0"):
            set_distance(-1)
    finally:
        set_distance(previous)
    assert previous == 8192


@requires_kernel
@pytest.mark.parametrize("k,n", [(576, 1536), (20, 7), (1, 5), (1536, 192), (33, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_batch(k, n, threads):
    """Each output's summation order is fixed: a row's result is bitwise the same alone, at
    any position of any batch, and with any thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weight, bias = operands(32, k, n, bias=True)
        full = kernel(x, weight, bias)
        for i in range(32):
            assert torch.equal(kernel(x[i:i + 1], weight, bias)[0], full[i]), f"row {i}"
        gen = torch.Generator().manual_seed(5)
        for m in (2, 5, 6, 7, 16, 17):
            rows = torch.randperm(32, generator=gen)[:m]
            other = torch.cat([torch.randn(3, k, generator=gen), x[rows]])  # shifted positions
            assert torch.equal(kernel(other, weight, bias)[3:], full[rows]), f"batch of {m + 3}"
    finally:
        torch.set_num_threads(previous)


def test_eligible_calls_use_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "_KERNEL", _FakeKernel(calls))
    monkeypatch.setattr(torch.ops, "kvforge_cpu_linear", _FakeOps(calls), raising=False)
    monkeypatch.delenv(cpu_linear.DISABLE_ENV, raising=False)
    x, weight, bias = operands(4, 8, 3, bias=True)
    with torch.no_grad():
        assert linear(x, weight, bias).shape == (4, 3)
        assert linear(x.view(2, 2, 8), weight).shape == (2, 2, 3)  # leading dims flattened
        assert linear(x.T.contiguous().T, weight).shape == (4, 3)  # non-contiguous x is copied
        strided_bias = torch.randn(3, 2)[:, 0]  # the 2-D fast path copies a strided bias too
        assert torch.equal(linear(x, weight, strided_bias), linear(x, weight, strided_bias.contiguous()))
    assert calls == ["op", "op", "op", "op", "op"]


@pytest.mark.parametrize("case", ["rows", "mixed_dtypes", "bias_dtype", "grad", "weight_grad", "disabled",
                                  "no_rows", "strided_weight", "float64"])
def test_falls_back_to_f_linear(case, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "_KERNEL", _FakeKernel(calls))
    monkeypatch.setattr(torch.ops, "kvforge_cpu_linear", _FakeOps(calls), raising=False)
    monkeypatch.delenv(cpu_linear.DISABLE_ENV, raising=False)
    x, weight, bias = operands(4, 8, 3, bias=True)
    if case == "rows":
        x = torch.randn(MAX_ROWS + 1, 8)
    elif case == "mixed_dtypes":  # F.linear itself refuses these; the kernel must not take them
        x = x.bfloat16()
    elif case == "bias_dtype":
        x, weight = x.bfloat16(), weight.bfloat16()
    elif case == "float64":
        x, weight, bias = x.double(), weight.double(), bias.double()
    elif case == "grad":
        x.requires_grad_(True)
    elif case == "weight_grad":
        weight.requires_grad_(True)
    elif case == "disabled":
        monkeypatch.setenv(cpu_linear.DISABLE_ENV, "1")
    elif case == "no_rows":
        x = torch.randn(0, 8)
    elif case == "strided_weight":
        weight = torch.randn(8, 3).T
    if case in ("mixed_dtypes", "bias_dtype"):
        with pytest.raises(RuntimeError):  # F.linear's own error, not the kernel's
            linear(x, weight, bias)
        assert "op" not in calls
        return
    out = linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert "op" not in calls
    if case in ("grad", "weight_grad"):
        out.sum().backward()  # autograd works through the fallback


@requires_kernel
@pytest.mark.parametrize("dtype,widen", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (37, 13), (20, 7), (1, 5), (70, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_two_byte_weights_accumulate_in_float32(dtype, widen, k, n, bias):
    """bf16/f16 x, W (and bias): every product and sum in float32, one rounding at the end,
    so the result is the correctly rounded exact value but for rare one-unit ties. bf16 runs
    the pairwise dot instruction where the CPU has it, or the widening path (widen=True)."""
    for m in (1, 3, 6, 7, 16, 32):
        x, weight, b = operands(m, k, n, bias, seed=m)
        x, weight, b = x.to(dtype), weight.to(dtype), None if b is None else b.to(dtype)
        out = torch.ops.kvforge_cpu_linear.small_m_linear(x, weight, b, widen)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert out.dtype == dtype and out.shape == exact.shape
        scale = (x.abs().double() @ weight.abs().double().T).max().item() + 1.0
        unit = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11  # half a unit in the last place
        torch.testing.assert_close(out.double(), exact, atol=1e-5 * scale, rtol=2 * unit)
        # float32 accumulation: nearly every output is the correctly rounded exact value
        assert (out == exact.to(dtype)).float().mean().item() > 0.98


@requires_kernel
@pytest.mark.parametrize("dtype,widen", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("k", [576, 70])
def test_two_byte_rows_do_not_depend_on_the_batch(dtype, widen, k):
    x, weight, bias = (t.to(dtype) for t in operands(32, k, 1536, bias=True))
    op = torch.ops.kvforge_cpu_linear.small_m_linear
    full = op(x, weight, bias, widen)
    for i in (0, 5, 31):
        assert torch.equal(op(x[i:i + 1], weight, bias, widen)[0], full[i])
    assert torch.equal(op(x[3:10], weight, bias, widen), full[3:10])


def test_parameters_needing_grad_use_the_kernel_under_no_grad(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "_KERNEL", _FakeKernel(calls))
    monkeypatch.setattr(torch.ops, "kvforge_cpu_linear", _FakeOps(calls), raising=False)
    monkeypatch.delenv(cpu_linear.DISABLE_ENV, raising=False)
    layer = torch.nn.Linear(8, 3)  # parameters require grad, as in every model
    with torch.inference_mode():
        linear(torch.randn(2, 8), layer.weight, layer.bias)
    assert calls == ["op"]


@requires_kernel
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "smollm2_tied", "gemma3_hybrid"])
def test_model_decode_same_logits_with_and_without_kernel(name, monkeypatch):
    _, model = make_pair(name)
    calls = []
    original = cpu_linear.linear
    for module in ("kvforge.models.layers", "kvforge.kernels.vocab_logits"):
        monkeypatch.setattr(f"{module}.linear", lambda *args: calls.append(1) or original(*args))
    prompts = [list(range(3, 30)), [7, 8], list(range(40, 52))]
    logits = {}
    for mode in ("kernel", "disabled"):
        if mode == "disabled":
            monkeypatch.setenv(cpu_linear.DISABLE_ENV, "1")
        logits[mode] = decode_logits(make_runner(model), prompts, steps=12)
    assert calls, "the models did not call kvforge.kernels.cpu_linear.linear"
    torch.testing.assert_close(logits["kernel"], logits["disabled"], atol=1e-5, rtol=0)


class _FakeKernel:
    """Stands in for the built kernel so dispatch tests run without a compiler."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def available(self) -> bool:
        return True


class _FakeOps:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def small_m_linear(self, x, weight, bias):
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == weight.dtype
        assert bias is None or bias.is_contiguous()  # the real op refuses a strided bias
        self.calls.append("op")
        return F.linear(x, weight, bias)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_many_products_equal_their_own_calls_bitwise(dtype, m):
    """small_m_linear_many (a layer's q/k/v, gate/up in one parallel range) gives each output
    exactly what its own call gives, whatever the other products' sizes."""
    gen = torch.Generator().manual_seed(m)
    k = 72
    x = torch.randn(m, k, generator=gen).to(dtype)
    shapes = [(37, True), (9, False), (130, True), (2, False)]
    weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for n, _ in shapes]
    biases = [torch.randn(n, generator=gen).to(dtype) if has else None for n, has in shapes]
    outs = torch.ops.kvforge_cpu_linear.small_m_linear_many(x, weights, biases)
    assert len(outs) == len(weights)
    for out, weight, bias in zip(outs, weights, biases):
        assert torch.equal(out, kernel(x, weight, bias))
    with pytest.raises(RuntimeError, match="one bias"):
        torch.ops.kvforge_cpu_linear.small_m_linear_many(x, weights, biases[:-1])


@requires_kernel
@pytest.mark.parametrize("widen", [False, True])
# n = 8: whole tiles of 4 outputs (vector rounding); 7: the last tile is partial (scalar)
@pytest.mark.parametrize("n", [8, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_outputs_round_like_torch(widen, n, bias):
    """With small integer operands every float32 sum is exact whatever its order, so the one
    rounding left is float32 -> bf16, which must be torch's own bit for bit: to nearest,
    ties to even (sums of 9 to 15 significant bits: exact ties occur). A NaN output is
    c10::BFloat16's NaN, 0x7FC0, on the vector and the scalar path alike, even from a NaN
    with its sign bit set (torch's tensor cast writes another NaN pattern, so NaNs are
    compared apart)."""
    gen = torch.Generator().manual_seed(n)
    for m in (1, 6, 16):
        x = torch.randint(-16, 17, (m, 64), generator=gen).to(torch.bfloat16)
        weight = torch.randint(-16, 17, (n, 64), generator=gen).to(torch.bfloat16)
        b = torch.randint(-300, 301, (n,), generator=gen).to(torch.bfloat16) if bias else None
        # 0xFFC0, a NaN with its sign bit set: outputs 1 (a whole tile) and n - 1 (the last
        # tile: partial when n = 7) of every row are NaN
        weight.view(torch.int16)[[1, n - 1], 5] = -64
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
        out = torch.ops.kvforge_cpu_linear.small_m_linear(x, weight, b, widen)
        expected = exact.to(torch.bfloat16)
        halfway = (exact.view(torch.int32) & 0xFFFF) == 0x8000  # exactly between two bf16 values
        assert halfway.sum().item() > 0, "the operands must produce ties"
        nan = expected.isnan()
        assert nan[:, [1, n - 1]].all() and nan.sum() == 2 * m
        assert torch.equal(out.view(torch.int16)[nan], torch.full((2 * m,), 0x7FC0, dtype=torch.int16))
        assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan]), f"m={m}"


@requires_kernel
def test_a_cpu_with_amx_gets_the_native_build():
    """On a Linux CPU that lists AMX-BF16 the kernel is built for it (-march=native) and the
    tile state is granted: a compile error in the native build would otherwise fall back to
    the portable flags without failing anything but the speed (it happened once, silently)."""
    import sys
    from pathlib import Path

    if not sys.platform.startswith("linux"):
        pytest.skip("AMX is used on Linux only")
    flags = {flag for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
             for flag in line.split(":", 1)[1].split()}
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags:
        pytest.skip("this CPU has no AMX-BF16")
    assert torch.ops.kvforge_cpu_linear.amx_supported()
