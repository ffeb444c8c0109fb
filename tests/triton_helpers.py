"""Where the Triton kernel tests of the full cache, ShadowKV and the fused ops run."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.triton_runtime import triton_installed


def kernel_device() -> str:
    """"cuda", or "cpu" in Triton's interpreter (which tests/conftest.py turns on without a
    GPU); skips the test, saying why, otherwise."""
    if not triton_installed():
        pytest.skip("the `triton` package is not installed (pip install 'kvforge[triton]')")
    from kvforge.kernels.triton_jit import INTERPRETED

    if torch.cuda.is_available():
        return "cuda"
    if INTERPRETED:
        return "cpu"
    pytest.skip("no CUDA, and Triton's interpreter is off (TRITON_INTERPRET was set to 0)")


def interpreted_or_skip() -> None:
    """Skips a test that runs Triton kernels on CPU tensors unless Triton's interpreter is
    on (tests/conftest.py turns it on only without CUDA: on a GPU machine such a test's
    kernels run on the GPU in the CUDA tests instead)."""
    if not triton_installed():
        pytest.skip("the `triton` package is not installed (pip install 'kvforge[triton]')")
    from kvforge.kernels.triton_jit import INTERPRETED

    if not INTERPRETED:
        pytest.skip("Triton kernels on CPU tensors need Triton's interpreter, which is off on a machine with CUDA")


def warps_of_launches(monkeypatch, module, kernel_name: str) -> list[int | None]:
    """Replace `module.kernel_name` by a spy that records each launch's `num_warps` and then
    launches the kernel; returns the list it fills."""
    kernel = getattr(module, kernel_name)
    warps: list[int | None] = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                warps.append(kwargs.get("num_warps"))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, kernel_name, Spy())
    return warps
