"""The kernel build lock: a build killed midway never blocks a later process, and a live
holder is waited for only up to a timeout, with a message that says how to clear it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvforge.kernels import build as build_module
from kvforge.kernels.build import CppKernel
from kvforge.kernels.build_lock import LOCK_NAME, TORCH_BATON, BuildLockTimeout, build_lock

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvforge.kernels.build_lock import build_lock
    with build_lock(sys.argv[1]):
        (Path(sys.argv[1]) / "lock").write_text("")  # what torch's baton leaves while compiling
        print("held", flush=True)
        time.sleep(120)
""")


def _hold(directory) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_killed_holder_does_not_block_and_its_torch_baton_is_cleared(tmp_path):
    holder = _hold(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    assert (tmp_path / TORCH_BATON).exists()  # what made later builds wait forever
    start = time.monotonic()
    with build_lock(tmp_path, timeout_s=30):
        assert not (tmp_path / TORCH_BATON).exists()
        assert (tmp_path / LOCK_NAME).read_text() == str(os.getpid())
    assert time.monotonic() - start < 5


def test_a_live_holder_times_out_with_the_lock_file_named(tmp_path):
    holder = _hold(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(BuildLockTimeout) as error:
            with build_lock(tmp_path, timeout_s=0.5):
                pass
        assert time.monotonic() - start < 5
        message = str(error.value)
        assert str(tmp_path / LOCK_NAME) in message and f"process {holder.pid}" in message
        assert "delete" in message and "KVFORGE_BUILD_LOCK_TIMEOUT" in message
        assert (tmp_path / TORCH_BATON).exists()  # a live build's baton is left alone
    finally:
        holder.kill()
        holder.wait(10)


class _FakeExtension:
    """cpp_extension stand-in: records whether torch's baton was present when load ran."""

    def __init__(self, root):
        self.root, self.saw_baton = root, []

    def get_default_build_root(self):
        return str(self.root)

    def is_ninja_available(self):
        return True

    def load(self, name, sources, build_directory, **kwargs):
        self.saw_baton.append(os.path.exists(os.path.join(build_directory, TORCH_BATON)))
        raise RuntimeError("compiler stand-in: no library")


def _kernel(tmp_path) -> CppKernel:
    source = tmp_path / "k.cpp"
    source.write_text("// nothing\n")
    return CppKernel("kvforge_test_kernel", source, "kvforge_test", "op", "test kernel", "the fallback",
                     flag_sets=(("-O1",),))


def test_kernel_build_clears_a_stale_baton_and_times_out_into_a_fallback(tmp_path, monkeypatch, caplog):
    root = tmp_path / "ext"
    fake = _FakeExtension(root)
    monkeypatch.setattr("torch.utils.cpp_extension", fake, raising=False)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", fake)
    monkeypatch.delenv(build_module.DISABLE_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # the build root must be the stand-in's
    kernel = _kernel(tmp_path)
    build_dir = root / f"kvforge_test_kernel_{kernel._fingerprint(('-O1',))}"
    build_dir.mkdir(parents=True)
    (build_dir / TORCH_BATON).write_text("")  # a killed build's leftover
    assert kernel.available() is False  # the stand-in never produces a library
    assert fake.saw_baton == [False]

    holder = _hold(build_dir)  # now a live build holds the directory
    try:
        monkeypatch.setenv("KVFORGE_BUILD_LOCK_TIMEOUT", "0.5")
        second = _kernel(tmp_path)
        with caplog.at_level(logging.WARNING):
            start = time.monotonic()
            assert second.available() is False
        assert time.monotonic() - start < 5
        assert any(LOCK_NAME in record.getMessage() and "the fallback" in record.getMessage()
                   for record in caplog.records)
        assert fake.saw_baton == [False]  # the second build never reached the compiler
    finally:
        holder.kill()
        holder.wait(10)


def test_a_compile_is_announced_before_it_starts_and_a_cached_build_is_not(tmp_path, monkeypatch, caplog):
    """A first use compiles for a minute or more: the user is told before the compiler runs
    (the stand-in compiler records what had been logged by then), and not when a build is
    already there."""
    root = tmp_path / "ext"
    fake = _FakeExtension(root)
    logged_before_compiling: list[str] = []
    real_load = fake.load

    def load(*args, **kwargs):
        logged_before_compiling.extend(record.getMessage() for record in caplog.records)
        return real_load(*args, **kwargs)

    fake.load = load
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", fake)
    monkeypatch.setattr("torch.utils.cpp_extension", fake, raising=False)
    monkeypatch.delenv(build_module.DISABLE_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    with caplog.at_level(logging.WARNING):
        assert _kernel(tmp_path).available() is False
    assert any("compiling the test kernel" in message and str(root) in message for message in logged_before_compiling)

    kernel = _kernel(tmp_path)
    name = f"kvforge_test_kernel_{kernel._fingerprint(('-O1',))}"
    (root / name / f"{name}.so").write_text("")  # a build is already there
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert kernel.available() is False  # (the stand-in still registers no operator)
    assert not any("compiling" in record.getMessage() for record in caplog.records)


def test_the_compile_command_names_no_checkout_so_copies_of_the_sources_share_a_build(tmp_path, monkeypatch):
    """The source and the shared headers are compiled from copies in the build directory:
    ninja rebuilds when its command changes, so a command naming the checkout's kernels/
    directory gave every checkout (a mutation run's scratch copies) a build of its own."""
    root = tmp_path / "ext"
    fake = _FakeExtension(root)
    seen: dict = {}
    real_load = fake.load

    def load(name, sources, build_directory, **kwargs):
        seen.update(sources=sources, include=kwargs["extra_include_paths"], build=build_directory)
        return real_load(name, sources, build_directory, **kwargs)

    fake.load = load
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", fake)
    monkeypatch.setattr("torch.utils.cpp_extension", fake, raising=False)
    monkeypatch.delenv(build_module.DISABLE_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    first, second = tmp_path / "checkout-a", tmp_path / "checkout-b"
    kernels = []
    for checkout in (first, second):
        checkout.mkdir()
        (checkout / "k.cpp").write_text('#include "cpu_checks.h"\n')
        kernels.append(CppKernel("kvforge_test_kernel", checkout / "k.cpp", "kvforge_test", "op", "test kernel",
                                 "the fallback", flag_sets=(("-O1",),)))
    assert kernels[0]._fingerprint(("-O1",)) == kernels[1]._fingerprint(("-O1",))
    assert kernels[0].available() is False  # (the stand-in builds nothing)
    build = Path(seen["build"])
    assert build.parent == root and seen["include"] == [str(build)]
    assert all(Path(source).parent == build for source in seen["sources"])
    assert (build / "cpu_checks.h").read_text() == (Path(build_module.__file__).parent / "cpu_checks.h").read_text()
    # a later load leaves the copies untouched: a newer mtime would make ninja compile again
    stamps = {path.name: path.stat().st_mtime_ns for path in build.iterdir() if path.suffix in (".h", ".cpp")}
    assert kernels[1].available() is False
    assert {path.name: path.stat().st_mtime_ns for path in build.iterdir() if path.suffix in (".h", ".cpp")} == stamps
    edited = CppKernel("kvforge_test_kernel", first / "k.cpp", "kvforge_test", "op", "test kernel", "the fallback",
                       flag_sets=(("-O1",),))
    edited.header_files = {**edited.header_files, "cpu_checks.h": "// edited\n"}
    assert edited._fingerprint(("-O1",)) != kernels[0]._fingerprint(("-O1",))  # an edited header rebuilds
