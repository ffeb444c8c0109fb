"""A fused op that computes a module's output without calling it (the residual adds with
their norms, the add in the down projection's GEMM) must not hide the module from its hooks:
where a hook would run, the module is called and the add runs apart. Run where the fused
ops serve (CUDA, or the CPU in Triton's interpreter), so the fused path is the one refused;
skipped, with the reason, without the `triton` package."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from kvforge.kernels import cuda_fused
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm, hooks_would_run


@pytest.fixture
def device(monkeypatch) -> str:
    found = kernel_device()
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", found)
    return found


@pytest.fixture
def calls(device, monkeypatch) -> list[str]:
    """Names of the fused launchers called, while the test runs."""
    kernels = cuda_fused._kernels()
    seen: list[str] = []
    for name in ("add_rms_norm_triton", "add_norm_of_triton"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, n=name, k=kernel, **kw: seen.append(n) or k(*a, **kw))
    return seen


def _doubling(module: torch.nn.Module, fired: list[int]) -> torch.utils.hooks.RemovableHandle:
    return module.register_forward_hook(lambda mod, args, out: fired.append(1) or out * 2)


def test_a_hooked_mlp_is_called_and_its_add_runs_apart(device) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, "silu", bias=False, device=device)
    residual, x = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    fired: list[int] = []
    with torch.no_grad():
        plain = mlp(x)
        handle = _doubling(mlp, fired)
        own = residual.clone()
        out = mlp.add_into(own, x)
        handle.remove()
    assert fired == [1] and torch.equal(own, residual)  # called once; the residual not written
    torch.testing.assert_close(out, residual + 2 * plain)


def test_a_global_hook_is_seen_too(device) -> None:
    mlp = GatedMLP(32, 48, "silu", bias=False, device=device)
    assert not hooks_would_run(mlp)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    try:
        assert hooks_would_run(mlp)
    finally:
        handle.remove()
    handle = mlp.register_full_backward_hook(lambda *args: None)
    assert hooks_would_run(mlp)
    handle.remove()


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_a_hooked_norm_is_called_beside_its_add(device, calls, cls) -> None:
    torch.manual_seed(1)
    norm, branch = cls(32, 1e-6, device=device), cls(32, 1e-6, device=device)
    x, delta = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    with torch.no_grad():
        total, normed = norm.add_and_norm(x, delta)
        sandwich_total, _ = norm.add_and_norm(x, delta, branch)
        added = norm.add_norm_of(x, delta)
        assert calls == ["add_rms_norm_triton", "add_rms_norm_triton", "add_norm_of_triton"]  # unhooked: fused
        calls.clear()
        fired: list[int] = []
        handle = _doubling(norm, fired)
        hooked_total, hooked_normed = norm.add_and_norm(x, delta)
        torch.testing.assert_close(hooked_normed, 2 * normed)
        torch.testing.assert_close(norm.add_norm_of(x, delta), x + 2 * (added - x))
        handle.remove()
        handle = _doubling(branch, fired)  # the sandwich's branch norm, hooked alone
        hooked_sandwich, _ = norm.add_and_norm(x, delta, branch)
        torch.testing.assert_close(hooked_sandwich - x, 2 * (sandwich_total - x))
        handle.remove()
    assert fired == [1, 1, 1] and calls == []
    torch.testing.assert_close(hooked_total, total)
