"""Every kernel build runs one ninja, whatever PATH holds: ninja 1.12+ records a command
line under a different hash than older releases, so two ninjas sharing a build directory
each read the other's build as "command line changed" and compile everything again."""

from __future__ import annotations

import os
import shutil
import sys
import types

from kvforge.kernels import build as build_module


class _Extension:
    def is_ninja_available(self) -> bool:
        return shutil.which("ninja") is not None


def _fake_ninja(directory) -> str:
    directory.mkdir(parents=True)
    binary = directory / "ninja"
    binary.write_text("#!/bin/sh\necho 1.0\n")
    binary.chmod(0o755)
    return str(binary)


def test_the_packaged_ninja_goes_first_even_when_path_has_another(tmp_path, monkeypatch):
    system = _fake_ninja(tmp_path / "system")
    packaged = _fake_ninja(tmp_path / "venv-bin")
    (tmp_path / "venv-bin" / "python").write_text("")  # the venv's other programs must not move ahead
    monkeypatch.setenv("PATH", os.path.dirname(system))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=os.path.dirname(packaged)))
    assert build_module._ensure_ninja(_Extension())
    assert os.path.realpath(shutil.which("ninja")) == packaged
    first = os.environ["PATH"].split(os.pathsep)[0]
    assert os.listdir(first) == ["ninja"]  # a directory of ninja alone
    once = os.environ["PATH"]
    assert build_module._ensure_ninja(_Extension())
    assert os.environ["PATH"] == once  # already first: PATH does not grow build after build


def test_without_the_package_the_ninja_on_path_builds(tmp_path, monkeypatch):
    system = _fake_ninja(tmp_path / "system")
    monkeypatch.setenv("PATH", os.path.dirname(system))
    monkeypatch.setitem(sys.modules, "ninja", None)  # `import ninja` raises ImportError
    assert build_module._ensure_ninja(_Extension())
    assert shutil.which("ninja") == system
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert not build_module._ensure_ninja(_Extension())
