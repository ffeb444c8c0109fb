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


def test_setup_builds_the_quanto_peers_extension_and_never_fails_on_it(monkeypatch):
    """`make setup` builds optimum-quanto's C++ extension (else the `hf-quanto` peer compiles
    it inside a user's first evaluation); a missing package or a failed build is reported,
    never raised, so setup goes on."""
    import importlib.util

    from kvforge.prebuild import build_quanto_extension

    if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None:
        assert build_quanto_extension() == "ready"
        from optimum.quanto.library import extensions

        def broken(name: str):
            raise RuntimeError(f"no compiler for {name}")

        monkeypatch.setattr(extensions, "get_extension", broken)
        assert build_quanto_extension() == "not built (RuntimeError: no compiler for quanto_cpp)"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert build_quanto_extension() == "not installed"
