"""Another version of a C++ kernel source, built beside the current one, for before/after
timings in one process (the `--baseline-source` option of the kernel benchmarks).

    op = build_baseline(Path("old.cpp"), namespace="kvforge_cpu", op="paged_decode_attention")

The copy registers its operators under `<namespace>_baseline`, so both versions load
together. It is built from a temporary directory with the current tree's shared headers
(kvforge/kernels/*.h) on the include path, as every kernel is (kernels/build.py).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kvforge.kernels.build import CppKernel


def build_baseline(source: Path, namespace: str, op: str) -> Callable:
    """torch.ops.<namespace>_baseline.<op>, built from `source` (which must register
    torch.ops.<namespace>.<op>); asserts that it built."""
    renamed = f"{namespace}_baseline"
    text = re.sub(rf"\b{namespace}\b", renamed, source.read_text(encoding="utf-8"))
    copy = Path(tempfile.mkdtemp()) / source.name
    copy.write_text(text, encoding="utf-8")
    kernel = CppKernel(name=renamed, source=copy, namespace=renamed, op=op, what=f"baseline {op}",
                       fallback="nothing")
    assert kernel.available(), f"the baseline source {source} did not build"
    return getattr(getattr(torch.ops, renamed), op)
