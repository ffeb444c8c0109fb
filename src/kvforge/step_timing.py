"""Where the time of an engine step goes: linear layers, attention, sampling, the rest.

Off unless an engine turns it on (`EngineConfig(step_timing=True)`): the hot paths then
pay one thread-local read per call. While a `StepTimer` is recording on a thread, the
linear-layer helper (`kernels.cpu_linear.linear`) and the cache calls of the model
(`write`, `attend`, `attend_rows`, through `TimedCache`) add their wall time to it.

On CUDA every measured call synchronises the device first and last, so the figures are
the device's time, at the price of those synchronisations (use it to study, not to serve
fast). Seconds are cumulative since the timer was made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

PARTS = ("linear", "attention", "sampling")

_local = threading.local()


class StepTimer:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        self.seconds: dict[str, float] = {part: 0.0 for part in PARTS}
        self.seconds["step"] = 0.0  # whole engine steps (the parts above are inside them)
        self.steps = 0

    def measure(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.synchronize is not None:
            self.synchronize()
        self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
        return out

    def split(self) -> dict[str, float]:
        """Seconds per part, with "other" = step time not in any part (embedding, norms,
        RoPE, scheduling, batch building, detokenising, Python overhead)."""
        parts = {part: self.seconds.get(part, 0.0) for part in PARTS}
        parts["other"] = max(0.0, self.seconds["step"] - sum(parts.values()))
        return parts


def current_timer() -> StepTimer | None:
    """The timer recording on this thread, if any."""
    return getattr(_local, "timer", None)


@contextmanager
def recording(timer: StepTimer | None) -> Iterator[None]:
    """Make `timer` the current timer of this thread for the block (None: no timing)."""
    previous = getattr(_local, "timer", None)
    _local.timer = timer
    try:
        yield
    finally:
        _local.timer = previous


class TimedCache:
    """A cache method seen through a timer: `write`, `attend` and `attend_rows` count as
    attention; everything else is passed through untouched."""

    def __init__(self, cache: Any, timer: StepTimer) -> None:
        self._cache = cache
        self._timer = timer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def write(self, *args: Any) -> None:
        self._timer.measure("attention", self._cache.write, *args)

    def attend(self, *args: Any) -> torch.Tensor:
        return self._timer.measure("attention", self._cache.attend, *args)

    def attend_rows(self, *args: Any) -> torch.Tensor:
        return self._timer.measure("attention", self._cache.attend_rows, *args)
