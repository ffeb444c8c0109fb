"""Every C++ kernel builds with its first flag set (-march=native) wherever the compiler
accepts those flags at all. A kernel whose native build fails falls back to portable flags
with only a logged warning and keeps passing every test, just slower (once, a compile error
in new AMX code cost the paged attention 4.6x its speed that way without failing anything):
this test turns that silent fallback into a failure."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess

import pytest

from kvforge.kernels.build import CppKernel, kernels_disabled
from kvforge.prebuild import CPU_KERNELS

# The modules that own the kernels `kvforge bench` prebuilds (each keeps its CppKernel as
# _KERNEL): a kernel added there is checked here too.
KERNEL_MODULES = sorted({check.__module__ for check in CPU_KERNELS.values()})


def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler the builds use compiles an empty program with `flags`."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return False
    result = subprocess.run([compiler, *flags, "-x", "c++", "-c", "-", "-o", os.devnull],
                            input="int main() { return 0; }\n", capture_output=True, text=True, check=False)
    return result.returncode == 0


@pytest.mark.skipif(kernels_disabled(), reason="KVFORGE_DISABLE_CPU_KERNELS is set")
@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_each_kernel_builds_with_its_first_flag_set(module):
    kernel = importlib.import_module(module)._KERNEL
    assert isinstance(kernel, CppKernel)
    if not compiler_accepts(kernel.flag_sets[0]):
        pytest.skip(f"the compiler rejects {' '.join(kernel.flag_sets[0])} even for an empty program")
    assert kernel.available(), f"{module}: the kernel did not build at all (see the logged warning)"
    assert kernel.loaded_flags == kernel.flag_sets[0], (
        f"{module}: built with {kernel.loaded_flags}, not {kernel.flag_sets[0]}: its native build fails")
