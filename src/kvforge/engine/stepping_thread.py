"""A warning for a CPU engine built on one thread and stepped on another.

In libgomp each OS thread that runs a parallel torch operation keeps its own OpenMP team
alive for the rest of its life. An engine whose construction ran torch (loading, warm-up,
prepacking, the bf16 probe) on one thread and whose steps run on another therefore has two
teams. Once the teams hold more threads than there are cores, libgomp shortens its
spin-wait and every parallel region wakes its workers through a futex: a served burst ran
about 8% slower that way (docs/benchmarks.md). Nothing can merge the teams afterwards, so
the engine says so once, naming the cure: build and step on one thread, as
`AsyncEngine.build_on_engine_thread` (and so `kvforge serve`) does.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def teams_oversubscribe(threads: int, cores: int) -> bool:
    """Whether two OpenMP teams of `threads` threads each hold more threads than `cores`."""
    return 2 * threads > cores


class SteppingThreadCheck:
    """Remembers the thread that built a CPU engine; `check()`, called at each step, warns
    once if a step runs on another thread while two teams would oversubscribe the cores."""

    def __init__(self, device: torch.device) -> None:
        self._built_on: int | None = threading.get_ident() if device.type == "cpu" else None

    def check(self) -> None:
        if self._built_on is None:  # the common case: one attribute read per step
            return
        built_on, self._built_on = self._built_on, None  # decided at the first step, said at most once
        stepping_on = threading.get_ident()
        threads, cores = torch.get_num_threads(), usable_cores()
        if stepping_on != built_on and teams_oversubscribe(threads, cores):
            logger.warning(
                "this CPU engine was built on one thread and is stepped on another: each keeps its own "
                "OpenMP team of %d threads on %d cores, so every parallel operation pays a wake-up "
                "(a served burst measured about 8%% slower). Build and step the engine on one thread "
                "(AsyncEngine.build_on_engine_thread does; kvforge serve uses it).", threads, cores)
