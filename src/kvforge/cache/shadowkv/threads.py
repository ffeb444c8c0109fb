"""Thread count of ShadowKV's small-operation phases on the CPU.

The sparse decode path runs many small tensor operations per (sequence, layer): scores over
a few thousand landmarks, a few hundred rebuilt rows, a softmax over ~1000 keys. With an
OpenMP pool of two threads on a machine whose cores are busy, each such operation waited for
the second thread and took far longer than on one
(docs/benchmarks.md#measurements-behind-design-choices), so these phases run on `threads`
threads (the tiny eigensolve of the key basis too). Large operations (model weights, the
compression of a whole sequence) keep torch's setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def cpu_threads(threads: int, device: torch.device) -> Iterator[None]:
    """Run the block with `threads` intra-op threads on CPU (0 or a non-CPU device: as is)."""
    current = torch.get_num_threads()
    if threads <= 0 or device.type != "cpu" or threads == current:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(current)
