"""Build-at-first-use for kvforge's C++ CPU kernels (shared by every kernel module).

A `CppKernel` compiles one C++ source with `torch.utils.cpp_extension.load` (needs a C++
compiler and `ninja`) the first time `available()` is called, and caches success or
failure for the process. The source registers its operators through TORCH_LIBRARY (no
pybind11), so loading the library is all that is needed to reach `torch.ops.<namespace>`.

Invariants:
- `available()` never raises; a failure is logged once per kernel as a warning
  ("kvforge CPU kernels disabled: ...") and callers use their PyTorch fallback.
- `KVFORGE_DISABLE_CPU_KERNELS` (anything but "" or "0") makes every kernel unavailable;
  it is read on every call, so it can be toggled at run time (tests do).
- A build holds `build_lock` (build_lock.py): a build killed midway never blocks a later
  process, and a live one is waited for only up to a timeout.
- The build directory name hashes the source and headers, the flags, torch (version and
  install path), Python and a CPU fingerprint, so `-march=native` binaries are never loaded
  on a different CPU, an edited source or header never loads a stale binary, and two
  environments never rebuild each other's builds; checkouts of the same sources on one
  environment share them (the compile command names only the build directory's copies).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import threading
import time
from pathlib import Path

import torch

from kvforge.kernels.build_lock import BuildLockTimeout, build_lock

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVFORGE_DISABLE_CPU_KERNELS"
# Floating dtypes the C++ kernels take for activations, weights and their outputs.
FLOAT_IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tried in order: the first that compiles wins. -march=native is safe because the build
# runs on the machine that loads it, and the build directory name hashes a CPU fingerprint
# (a shared cache directory never hands a binary to a different CPU). -fopenmp is needed for
# at::parallel_for to run in parallel (ATen's OpenMP backend is inlined into the library,
# and is serial without _OPENMP) and for `omp simd` hints; the libgomp it links resolves to
# the copy torch has already loaded (same soname), so torch.set_num_threads applies. The
# last set (no OpenMP: serial, e.g. Apple clang) is still much faster than the fallbacks.
DEFAULT_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)


# `os.environ.get` encodes the key and decodes the value on every call, and this runs
# twice per linear layer of every decode step: a visible part of a small model's batch-1
# step (docs/benchmarks.md#measurements-behind-design-choices). On
# CPython, os.environ keeps the raw values in `_data` (updated by os.environ[...] = and by
# monkeypatch.setenv alike), so one dict lookup finds whether the variable is set at all.
_RAW_ENVIRON = getattr(os.environ, "_data", None)
try:
    _RAW_DISABLE_KEY = os.environ.encodekey(DISABLE_ENV)  # type: ignore[attr-defined]
except AttributeError:  # another Python: the plain lookup below
    _RAW_DISABLE_KEY = None


def kernels_disabled() -> bool:
    """True when the environment asks for the PyTorch fallbacks (read on every call)."""
    if isinstance(_RAW_ENVIRON, dict) and _RAW_DISABLE_KEY is not None and _RAW_DISABLE_KEY not in _RAW_ENVIRON:
        return False  # not set: the common case, one dict lookup
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


class CppKernel:
    """One C++ source built lazily into a library that registers `torch.ops.<namespace>.<op>`.

    `name` prefixes the build directory; `what` and `fallback` only word the log messages.
    """

    def __init__(self, name: str, source: Path, namespace: str, op: str, what: str, fallback: str,
                 flag_sets: tuple[tuple[str, ...], ...] = DEFAULT_FLAG_SETS) -> None:
        self.name = name
        self.source = source.read_text(encoding="utf-8")
        # The shared headers (cpu_checks.h, ...) are copied beside the source in the build
        # directory, so the compile command names no checkout, and hashed into the
        # fingerprint, so an edited header rebuilds every kernel that includes it.
        self.header_files = {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parent.glob("*.h"))}
        self.namespace = namespace
        self.op = op
        self.what = what
        self.fallback = fallback
        self.flag_sets = flag_sets
        self.build_seconds: float | None = None  # time of the successful load (compile or cache)
        self.loaded_flags: tuple[str, ...] | None = None  # the flag set that built (None: none yet)
        self._lock = threading.Lock()
        self._built: bool | None = None  # None: not tried yet

    def available(self) -> bool:
        """True when the compiled kernel can be used (builds it on the first call)."""
        if kernels_disabled():
            return False
        if self._built is None:
            with self._lock:
                if self._built is None:
                    self._built = self._build()
        return self._built

    # -- building -------------------------------------------------------------------------
    def _build(self) -> bool:
        """Compile (or load the cached build of) the kernel; never raises."""
        try:
            from torch.utils import cpp_extension
        except Exception as error:  # noqa: BLE001 - any import problem means "no kernel"
            logger.warning("kvforge CPU kernels disabled: torch.utils.cpp_extension unavailable (%s)", error)
            return False
        if not _ensure_ninja(cpp_extension):
            logger.warning("kvforge CPU kernels disabled: `ninja` was not found (pip install ninja); "
                           "using %s", self.fallback)
            return False
        errors: list[str] = []
        for flags in self.flag_sets:
            try:
                self._load(cpp_extension, flags)
                return True
            except BuildLockTimeout as error:  # another flag set would wait just the same
                logger.warning("kvforge CPU kernels disabled: %s; using %s", error, self.fallback)
                return False
            except Exception as error:  # noqa: BLE001 - compiler failures come as many types
                errors.append(f"flags {' '.join(flags)}: {_tail(str(error))}")
        logger.warning("kvforge CPU kernels disabled: building the %s failed; using %s.\n%s", self.what,
                       self.fallback, "\n".join(errors))
        return False

    def _load(self, cpp_extension, flags: tuple[str, ...]) -> None:
        name = f"{self.name}_{self._fingerprint(flags)}"
        build_dir = os.path.join(build_root(), name)
        source = os.path.join(build_dir, f"{name}.cpp")
        start = time.perf_counter()
        openmp = ["-fopenmp"] if "-fopenmp" in flags else []
        with build_lock(build_dir):  # never waits forever on a killed build (build_lock.py)
            _write_if_changed(source, self.source)
            for header, text in self.header_files.items():
                _write_if_changed(os.path.join(build_dir, header), text)
            cached = os.path.exists(os.path.join(build_dir, f"{name}.so"))
            if not cached:  # said before the compiler runs: a first use otherwise looks like a hang
                logger.warning("kvforge: compiling the %s for this CPU (once per kernel source, torch and CPU; "
                               "kept in %s; `python -m kvforge.prebuild` compiles them all ahead)", self.what,
                               build_root())
            cpp_extension.load(name=name, sources=[source], extra_cflags=list(flags), extra_ldflags=openmp,
                               extra_include_paths=[build_dir], build_directory=build_dir,
                               is_python_module=False, verbose=False)
        getattr(getattr(torch.ops, self.namespace), self.op)  # raises if not registered
        self.build_seconds = time.perf_counter() - start
        self.loaded_flags = flags
        action = "loaded cached build of" if cached else "compiled"
        logger.info("kvforge: %s the %s in %.1f s (%s, flags %s)", action, self.what, self.build_seconds,
                    build_dir, " ".join(flags))

    def _fingerprint(self, flags: tuple[str, ...]) -> str:
        """Hash of everything the binary depends on: source, headers, flags, torch, Python
        and the CPU, and the include paths the compile command names (torch's and Python's
        headers): ninja rebuilds when its command changes, so two environments sharing one
        build directory would each recompile the other's build on every load (a CI clone's
        venv once made the next demo compile inside its timed decode). No checkout path is
        in it: checkouts of the same sources on one environment (a mutation run's scratch
        copies) share their builds."""
        headers = "".join(f"{name}\0{text}" for name, text in self.header_files.items())
        parts = [self.source, headers, " ".join(flags), torch.__version__, platform.python_version(), platform.machine(),
                 cpu_description(), os.path.dirname(torch.__file__), sysconfig.get_paths()["include"]]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_root() -> str:
    """Where kernels are built and kept: $TORCH_EXTENSIONS_DIR, else torch's default (per
    user, per torch build)."""
    from torch.utils import cpp_extension

    return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def cpu_description() -> str:
    """The CPU's model name and feature flags (what a build or a timing depends on)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


_ninja_lock = threading.Lock()


def _ensure_ninja(cpp_extension) -> bool:
    """Put one ninja first on PATH for every build: the `ninja` package's (a dependency),
    else whichever PATH has. One binary matters: ninja 1.12+ hashes a command line
    differently from older releases, so a build recorded by one reads as "command line
    changed" to the other and compiles again. A system ninja 1.11 on PATH with the venv
    inactive (`make test`) and the package's 1.13 with it active (a user's shell) rebuilt
    every kernel at each switch. PATH gains a directory holding a link to that ninja alone
    (the package's directory is the venv's bin/, whose python and pip must not move ahead)."""
    with _ninja_lock:  # kernels build on several threads (prebuild)
        try:
            import ninja  # type: ignore[import-not-found]

            bin_dir = getattr(ninja, "BIN_DIR", None)
            bundled = shutil.which("ninja", path=bin_dir) if bin_dir else None
        except ImportError:
            bundled = None
        first = shutil.which("ninja")
        if bundled is not None and (first is None or os.path.realpath(first) != os.path.realpath(bundled)):
            os.environ["PATH"] = _directory_of_only(bundled) + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.is_ninja_available()


def _directory_of_only(binary: str) -> str:
    """A directory under the build root whose one entry is a link to `binary` (its own
    directory where links cannot be made). One per binary: another environment's link is
    never repointed under a running process."""
    directory = os.path.join(build_root(), f"kvforge-ninja-{hashlib.sha256(binary.encode()).hexdigest()[:12]}")
    link = os.path.join(directory, os.path.basename(binary))
    try:
        os.makedirs(directory, exist_ok=True)
        if not (os.path.islink(link) and os.readlink(link) == binary):
            staged = f"{link}.{os.getpid()}"
            os.symlink(binary, staged)
            os.replace(staged, link)  # atomic: a process reading the link never sees it missing
    except OSError:
        return os.path.dirname(binary)
    return directory


def _write_if_changed(path: str, text: str) -> None:
    # Rewriting an identical file would bump its mtime and make ninja rebuild.
    try:
        with open(path) as existing:
            if existing.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as out:
        out.write(text)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
