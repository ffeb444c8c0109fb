"""Where the time of an engine step goes: linear layers, attention, sampling, the rest.

Off unless an engine turns it on (`EngineConfig(step_timing=True)`): the hot paths then
pay one thread-local read per call. While a `StepTimer` is recording on a thread, the
linear-layer helper (`kernels.cpu_linear.linear`) and the cache calls of the model
(`write`, `attend`, `attend_rows`, through `TimedCache`) add their wall time to the step
being timed. Each finished step is filed under its kind: "decode" (every sequence adds
one generated token) or "prefill" (the step computes prompt tokens, possibly beside
decode tokens), since the two are bounded by different things.

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
STEP_KINDS = ("decode", "prefill")

_local = threading.local()


class StepTimer:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        # kind -> part -> seconds; "step" is the whole step, the other parts lie inside it
        self.seconds: dict[str, dict[str, float]] = {kind: dict.fromkeys((*PARTS, "step"), 0.0)
                                                     for kind in STEP_KINDS}
        self.steps: dict[str, int] = dict.fromkeys(STEP_KINDS, 0)
        self._current: dict[str, float] = {}

    def measure(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` and add its wall time to `part` of the step being timed."""
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.synchronize is not None:
            self.synchronize()
        self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - start
        return out

    def time_step(self, fn: Callable[[], Any], kind_of: Callable[[], str]) -> Any:
        """Run one step under this timer; file it under `kind_of()` (asked after it ran)."""
        self._current = {}
        with recording(self):
            out = self.measure("step", fn)
        kind = kind_of()
        totals = self.seconds[kind]
        for part, seconds in self._current.items():
            totals[part] = totals.get(part, 0.0) + seconds
        self.steps[kind] += 1
        return out

    def split(self, kind: str | None = None) -> dict[str, float]:
        """Seconds per part of the steps of `kind` (None: all), with "other" = step time in
        no part (embedding, norms, RoPE, scheduling, batch building, detokenising, Python)."""
        kinds = STEP_KINDS if kind is None else (kind,)
        parts = {part: sum(self.seconds[k][part] for k in kinds) for part in PARTS}
        step = sum(self.seconds[k]["step"] for k in kinds)
        parts["other"] = max(0.0, step - sum(parts.values()))
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

    def fused_decode_target(self, cache_layer: int, meta: Any) -> None:
        """Never: a fused decoder-layer op would store and attend past the timer."""
        return None

    def write(self, *args: Any) -> None:
        self._timer.measure("attention", self._cache.write, *args)

    def attend(self, *args: Any) -> torch.Tensor:
        return self._timer.measure("attention", self._cache.attend, *args)

    def attend_rows(self, *args: Any) -> torch.Tensor:
        return self._timer.measure("attention", self._cache.attend_rows, *args)
