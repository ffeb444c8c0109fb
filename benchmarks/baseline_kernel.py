"""Another version of a C++ kernel source, built beside the current one, for before/after
timings in one process (the `--baseline-source` option of the kernel benchmarks).

    op = build_baseline(Path("old.cpp"), namespace="kvforge_cpu", op="paged_decode_attention")

The copy registers its operators under `<namespace>_baseline`, so both versions load
together. It is built from a temporary directory with the current tree's shared headers
(kvforge/kernels/*.h) on the include path, as every kernel is (kernels/build.py), and with
the native flags only: an older source that uses a header definition since removed (e.g.
`kvforge_bf16::sums16`) once built silently with the plain flags instead, without the bf16
path it was meant to compare.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kvforge.kernels.build import DEFAULT_FLAG_SETS, CppKernel

# Only the first (native) flag set: with a later, plainer one a source would build without
# the vector paths it is meant to compare.
NATIVE_FLAGS = DEFAULT_FLAG_SETS[0]


def build_baseline(source: Path, namespace: str, op: str) -> Callable:
    """torch.ops.<namespace>_baseline.<op>, built from `source` (which must register
    torch.ops.<namespace>.<op>); asserts that it built."""
    renamed = f"{namespace}_baseline"
    text = re.sub(rf"\b{namespace}\b", renamed, source.read_text(encoding="utf-8"))
    copy = Path(tempfile.mkdtemp()) / source.name
    copy.write_text(text, encoding="utf-8")
    kernel = CppKernel(name=renamed, source=copy, namespace=renamed, op=op, what=f"baseline {op}",
                       fallback="nothing", flag_sets=(NATIVE_FLAGS,))
    assert kernel.available(), (
        f"the baseline source {source} did not build with {' '.join(NATIVE_FLAGS)} (the first flags the tree's "
        "kernels try); if it uses a kvforge/kernels/*.h definition the tree no longer has, paste that "
        "definition into the baseline source")
    return getattr(getattr(torch.ops, renamed), op)
