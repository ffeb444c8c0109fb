"""Batched paged decode attention on CPU, as a C++ kernel compiled at first use.

`paged_decode_attention_cpu` has exactly the semantics of
`kvforge.cache.attention.decode_attention` (without `tile_pages`), but reads every visible
K/V row once, in place, from the paged storage: no gather copy, no bmm temporaries. Work
is split over (sequence, kv head) pairs, and long pairs into slices whose partial softmax
states are merged, with `at::parallel_for` (so `torch.set_num_threads` applies). The
`heads // kv_heads` queries of a group are processed together, so each loaded row serves
all of them.

The kernel is built lazily by `cpu_kernels_available()` with
`torch.utils.cpp_extension.load` (needs a C++ compiler and `ninja`). Success or failure is
cached for the process; a failure is logged once as a warning and callers fall back to the
PyTorch path. `KVFORGE_DISABLE_CPU_KERNELS=1` forces the fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = (Path(__file__).with_name("cpu_paged_attention.cpp")).read_text(encoding="utf-8")

DISABLE_ENV = "KVFORGE_DISABLE_CPU_KERNELS"
_OP_NAMESPACE = "kvforge_cpu"  # torch.ops.kvforge_cpu.paged_decode_attention (TORCH_LIBRARY in the source)
# Tried in order: the first that compiles wins. -march=native is safe because the build
# runs on the machine that loads it, and the build directory name hashes a CPU fingerprint
# (a shared cache directory never hands a binary to a different CPU). -fopenmp is needed for
# at::parallel_for to run in parallel (ATen's OpenMP backend is inlined into this library,
# and is serial without _OPENMP) and for the `omp simd` hints; the libgomp it links resolves
# to the copy torch has already loaded (same soname), so torch.set_num_threads applies. The
# last set (no OpenMP: serial, e.g. Apple clang) is still much faster than the fallback.
_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)

_lock = threading.Lock()
_built: bool | None = None  # None: not tried yet


def cpu_kernels_available() -> bool:
    """True when the compiled kernel can be used (builds it on the first call)."""
    global _built
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return False
    if _built is None:
        with _lock:
            if _built is None:
                _built = _build()
    return _built


def paged_decode_attention_cpu(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
                               k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                               first_page_position: torch.Tensor, visible_from: torch.Tensor,
                               visible_to: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its own new key plus stored keys, accumulated in float32.

    Shapes and meaning as `decode_attention`: q [B, heads, D]; k_self/v_self [B, kv_heads, D];
    k_pages/v_pages [kv_heads, num_pages, block, D] (float32/bfloat16/float16, any strides
    with unit stride along D, e.g. the view `store[layer]`); page_table [B, P] int64; the
    token in column j of row b has position first_page_position[b] + j and is visible iff
    visible_from[b] <= position < visible_to[b]. Returns [B, heads, D] in q's dtype.
    Raises RuntimeError when the kernel is unavailable; check `cpu_kernels_available()`.
    """
    if not cpu_kernels_available():
        raise RuntimeError("the CPU paged attention kernel is not available "
                           f"(build failed or {DISABLE_ENV} is set)")
    if not (q.is_cpu and k_pages.is_cpu and v_pages.is_cpu):  # the C++ side checks the rest
        raise ValueError("paged_decode_attention_cpu takes CPU tensors only")
    # Only the small per-step tensors are normalised here (copies of O(B * heads * D)), and
    # only when needed: this runs once per layer and decode step, so its overhead counts.
    # The page storage is passed as is. Storage without unit stride along D would have to
    # be copied whole, which defeats the kernel; no cache in kvforge produces one.
    if k_pages.stride(-1) != 1:
        k_pages = k_pages.contiguous()
    if v_pages.stride(-1) != 1:
        v_pages = v_pages.contiguous()
    out = torch.ops.kvforge_cpu.paged_decode_attention(
        _as(q, torch.float32), _as(k_self, torch.float32), _as(v_self, torch.float32), k_pages, v_pages,
        _as(page_table, torch.int64), _as(first_page_position, torch.int64), _as(visible_from, torch.int64),
        _as(visible_to, torch.int64), float(scale))
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


# -- building -----------------------------------------------------------------------------
def _build() -> bool:
    """Compile (or load the cached build of) the kernel; never raises."""
    try:
        from torch.utils import cpp_extension
    except Exception as error:  # noqa: BLE001 - any import problem means "no kernel"
        logger.warning("kvforge CPU kernels disabled: torch.utils.cpp_extension unavailable (%s)", error)
        return False
    if not _ensure_ninja(cpp_extension):
        logger.warning("kvforge CPU kernels disabled: `ninja` was not found (pip install ninja); "
                       "using the PyTorch decode attention")
        return False
    errors: list[str] = []
    for flags in _FLAG_SETS:
        try:
            _load(cpp_extension, flags)
            return True
        except Exception as error:  # noqa: BLE001 - compiler failures come as many types
            errors.append(f"flags {' '.join(flags)}: {_tail(str(error))}")
    logger.warning("kvforge CPU kernels disabled: building the paged attention kernel failed; using "
                   "the PyTorch decode attention.\n%s", "\n".join(errors))
    return False


def _load(cpp_extension, flags: tuple[str, ...]) -> None:
    name = f"kvforge_cpu_paged_attention_{_fingerprint(flags)}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    source = os.path.join(build_dir, f"{name}.cpp")
    _write_if_changed(source, SOURCE)
    cached = os.path.exists(os.path.join(build_dir, f"{name}.so"))
    start = time.perf_counter()
    openmp = ["-fopenmp"] if "-fopenmp" in flags else []
    cpp_extension.load(name=name, sources=[source], extra_cflags=list(flags), extra_ldflags=openmp,
                       build_directory=build_dir, is_python_module=False, verbose=False)
    op = getattr(torch.ops, _OP_NAMESPACE).paged_decode_attention  # raises if not registered
    del op
    action = "loaded cached build of" if cached else "compiled"
    logger.info("kvforge: %s the CPU paged attention kernel in %.1f s (%s, flags %s)", action,
                time.perf_counter() - start, build_dir, " ".join(flags))


def _fingerprint(flags: tuple[str, ...]) -> str:
    """Hash of everything the binary depends on: source, flags, torch, Python and the CPU."""
    parts = [SOURCE, " ".join(flags), torch.__version__, platform.python_version(), platform.machine(),
             _cpu_description()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_description() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _ensure_ninja(cpp_extension) -> bool:
    if cpp_extension.is_ninja_available():
        return True
    try:  # the `ninja` PyPI package, whose binary is not on PATH unless the venv is active
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return False
    binary = shutil.which("ninja", path=ninja.BIN_DIR)
    if binary is None:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.is_ninja_available()


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
