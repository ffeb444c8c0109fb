"""The residual add after the MLP, folded into the down projection's GEMM on CUDA
(`GatedMLP.add_into`, `cuda_fused.linear_into`): one in-place `addmm_` whose sum is rounded
once, against its definition and against the add apart; and every call it must refuse.
On CUDA, or with the dispatch pointed at the CPU (where `addmm_` is the same definition);
skipped, with the reason, without the `triton` package (the fused ops' switch needs it)."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from kvforge.kernels import cuda_fused
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.layers import GatedMLP
from kvforge.step_timing import StepTimer, recording


@pytest.fixture
def device(monkeypatch) -> str:
    found = kernel_device()
    monkeypatch.setenv(DISABLE_ENV, "1")  # the CPU's own kernels off: the fallback is the PyTorch expression
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", found)
    return found


def _mlp(dtype: torch.dtype, device: str, bias: bool = False) -> tuple[GatedMLP, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    mlp = GatedMLP(64, 160, "silu", bias=bias, dtype=dtype, device=device)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    residual = (torch.randn(8, 64, generator=gen) * 2).to(dtype).to(device)
    x = torch.randn(8, 64, generator=gen).to(dtype).to(device)
    return mlp, residual, x


def _apart(mlp: GatedMLP, residual: torch.Tensor, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
        return residual + mlp(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_down_projection_adds_itself_into_the_residual(device, dtype, monkeypatch) -> None:
    mlp, residual, x = _mlp(dtype, device)
    with torch.no_grad():
        apart = _apart(mlp, residual, x, monkeypatch)
        gated = mlp._gated(x)
        exact = residual.double() + gated.double() @ mlp.down_proj.weight.double().T
        own = residual.clone()
        out = mlp.add_into(own, x)
    assert out.data_ptr() == own.data_ptr() and torch.equal(out, own)  # in place: no add launched apart
    if dtype == torch.float32:
        torch.testing.assert_close(out, apart, atol=1e-5, rtol=1e-5)
    else:
        # the sum rounded once (the GEMM's epilogue adds in float32), where the ops apart
        # round the product to bf16 first and then the sum: about a quarter of them differ
        once = exact.to(dtype)
        assert (out == once).float().mean() >= 0.97
        assert (apart == once).float().mean() < 0.9
        assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3).all()  # within a unit everywhere


def test_a_projection_with_a_bias_adds_apart(device, monkeypatch) -> None:
    mlp, residual, x = _mlp(torch.float32, device, bias=True)
    with torch.no_grad():
        own = residual.clone()
        out = mlp.add_into(own, x)
        torch.testing.assert_close(out, _apart(mlp, residual, x, monkeypatch), atol=1e-5, rtol=1e-5)
    assert torch.equal(own, residual)  # refused: the residual untouched


def test_under_autograd_the_add_runs_apart_and_differentiates(device, monkeypatch) -> None:
    mlp, residual, x = _mlp(torch.float32, device)
    leaf = residual.clone().requires_grad_(True)
    out = mlp.add_into(leaf, x)
    assert out.data_ptr() != leaf.data_ptr()
    out.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.ones_like(residual))
    assert mlp.down_proj.weight.grad is not None


def test_off_the_served_device_the_residual_add_is_the_ops_apart(monkeypatch) -> None:
    """The CPU path (dispatch serving CUDA): bitwise `residual + mlp(x)`, out of place."""
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", "cuda")
    mlp, residual, x = _mlp(torch.bfloat16, "cpu")
    with torch.no_grad():
        own = residual.clone()
        out = mlp.add_into(own, x)
        assert torch.equal(out, residual + mlp(x)) and torch.equal(own, residual)


def test_mismatched_or_strided_operands_are_refused(device) -> None:
    weight = torch.randn(64, 160, device=device)
    assert cuda_fused.linear_into(torch.zeros(8, 64, device=device), torch.randn(8, 160, device=device).bfloat16(),
                                  weight, None) is None
    assert cuda_fused.linear_into(torch.zeros(8, 64, device=device), torch.randn(160, 8, device=device).t(),
                                  weight, None) is None
    assert cuda_fused.linear_into(torch.zeros(4, 64, device=device), torch.randn(8, 160, device=device),
                                  weight, None) is None
    out = torch.zeros(2, 4, 64, device=device)  # leading dims flattened in place
    x = torch.randn(2, 4, 160, device=device)
    assert cuda_fused.linear_into(out, x, weight, None) is out
    torch.testing.assert_close(out, x @ weight.T, atol=1e-4, rtol=1e-4)


def test_a_timed_step_files_the_gemm_under_linear(device) -> None:
    mlp, residual, x = _mlp(torch.float32, device)
    timer = StepTimer()
    parts: list[str] = []
    measure = timer.measure
    timer.measure = lambda part, fn, *args: parts.append(part) or measure(part, fn, *args)
    with torch.no_grad(), recording(timer):
        mlp.add_into(residual.clone(), x)
    assert parts.count("linear") == 3  # gate, up, and down with the add
