"""Fixed device tensors that a captured step reads (CUDA graphs replay kernels against fixed
addresses), and their refill, one host-to-device copy per step.

Every per-step input of a static decode step (token ids, positions, each layer group's
slots, page tables and visible ranges) is an int64 view into one flat device buffer. A
step's values are written into a host buffer of the same layout (pinned on CUDA) and sent
in one non-blocking copy, queued before the replay on the same stream: the replay reads
them, and the tensors themselves never move.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kvforge.errors import ConfigError


class StaticBuffers:
    """Named int64 tensors of fixed shapes, views of one device buffer."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> None:
        self.device = torch.device(device)
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}  # name -> (offset, shape)
        offset = 0
        for name, shape in shapes.items():
            self._layout[name] = (offset, tuple(shape))
            offset += math.prod(shape)
        self.size = offset
        self._flat = torch.zeros(offset, dtype=torch.long, device=self.device)
        self.tensors = {name: self._view(self._flat, name) for name in self._layout}

    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        offset, shape = self._layout[name]
        return flat[offset:offset + math.prod(shape)].view(shape)

    def fill(self, values: Mapping[str, torch.Tensor]) -> None:
        """Write every buffer at once: `values` holds a host tensor of each name's exact shape."""
        if values.keys() != self._layout.keys():
            raise ConfigError("values", sorted(values), f"must name exactly the buffers {sorted(self._layout)}")
        host = torch.empty(self.size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        for name, value in values.items():
            view = self._view(host, name)
            if tuple(value.shape) != view.shape:
                raise ConfigError(name, tuple(value.shape), f"must have the buffer's shape {tuple(view.shape)}")
            view.copy_(value)
        # From pinned memory the copy is queued on the current stream, before the replay that
        # reads it; the caching host allocator keeps `host` alive until the copy is done.
        self._flat.copy_(host, non_blocking=True)
