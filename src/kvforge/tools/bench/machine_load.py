"""How busy the machine was while a benchmark ran, and what that means for its figures.

`LoadProbe` reads the machine's CPU time (/proc/stat) and this process's own (and its
waited-for children's, e.g. the servers of `bench serve`) at the start and the end of the
measurements. The difference is the CPU time *other* programs took, divided by the wall
time: the cores they kept busy on average. On a 2-core machine, one other CPU-bound
program shows as about 1.0 and halves what a 2-thread benchmark can get. The 1/5/15-minute
load averages are kept too, but they lag by a minute, which the probe does not.

The probe also records the OpenMP thread settings the process runs under
(`thread_settings`). `OMP_WAIT_POLICY=PASSIVE` puts OpenMP threads to sleep between
parallel regions: each of the ~200 small regions of a decode step then waits for a
wake-up. Decode loses time under it, by a different amount per system
(docs/benchmarks.md#how-a-benchmark-runs), so ratios measured under it do not hold at the
default setting; such runs are flagged.

`flags` turns that and the other things a benchmark cannot vouch for into warnings that
go into the printed table and the JSON: a loaded machine, sleeping OpenMP threads, a single
repeat, repeats that disagree, and a ratio above what the work itself allows (its analytic
bound).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

# Cores kept busy by other programs above which a speed figure is flagged: a quarter core
# already costs a 2-thread benchmark on 2 cores an eighth of its time.
FOREIGN_CORES_LIMIT = 0.25
NOISY_SPREAD = 1.15  # slowest / fastest timed repeat above which the repeats disagree
BOUND_TOLERANCE = 1.1  # a ratio may exceed its analytic bound by this much (rounding, caches)
# Environment variables that change how OpenMP threads wait; recorded with every result.
THREAD_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


def thread_settings() -> dict[str, str]:
    """The OpenMP settings of THREAD_SETTINGS that are set in this process's environment."""
    return {name: os.environ[name] for name in THREAD_SETTINGS if name in os.environ}


def sleeping_threads(settings: dict[str, str]) -> str | None:
    """The setting that makes OpenMP threads sleep between parallel regions, or None."""
    if settings.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return "OMP_WAIT_POLICY=" + settings["OMP_WAIT_POLICY"]
    if settings.get("GOMP_SPINCOUNT", "").strip() == "0":
        return "GOMP_SPINCOUNT=0"
    return None


def _machine_busy_seconds() -> float | None:
    """CPU seconds all programs spent outside idle and iowait since boot (None if unknown)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass
class LoadProbe:
    started_wall: float = field(default_factory=time.perf_counter)
    started_busy: float | None = field(default_factory=_machine_busy_seconds)
    started_own: float = field(default_factory=_own_seconds)
    load_before: list[float] | None = field(default_factory=load_average)

    def report(self, also_own_s: float = 0.0) -> dict[str, Any]:
        """Foreign cores (None where /proc/stat is missing), the load averages and the
        OpenMP thread settings. `also_own_s`: CPU seconds of processes this run started that
        its own and its waited-for children's time does not hold (a server's unwaited workers)."""
        wall = time.perf_counter() - self.started_wall
        busy = _machine_busy_seconds()
        foreign = None
        if busy is not None and self.started_busy is not None and wall > 0:
            own = _own_seconds() - self.started_own + also_own_s
            foreign = max(0.0, (busy - self.started_busy - own) / wall)
        return {"foreign_cores": None if foreign is None else round(foreign, 3), "cpu_count": os.cpu_count(),
                "load_average_before": self.load_before, "load_average_after": load_average(),
                "thread_settings": thread_settings()}


def flags(load: dict[str, Any], repeats: int | None = None, spread: float | None = None,
          bounds: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """Warnings about what a result cannot vouch for: [{"kind", "message"}]."""
    out: list[dict[str, str]] = []
    foreign = load.get("foreign_cores")
    if foreign is not None and foreign > FOREIGN_CORES_LIMIT:
        out.append({"kind": "loaded_machine",
                    "message": f"other programs kept {foreign:.2f} of {load.get('cpu_count')} cores busy during the "
                               f"measurement (load average {load.get('load_average_before')} before, "
                               f"{load.get('load_average_after')} after): speed figures are not trustworthy"})
    sleeping = sleeping_threads(load.get("thread_settings") or {})
    if sleeping is not None:
        out.append({"kind": "sleeping_threads",
                    "message": f"{sleeping}: OpenMP threads slept between parallel regions, which slows each "
                               "system by a different amount; speed figures and ratios are not comparable with a "
                               "run at the default setting"})
    if repeats is not None and repeats < 2:
        out.append({"kind": "single_repeat",
                    "message": "one timed repeat: no spread to judge the noise by (use --repeats 3)"})
    if spread is not None and spread > NOISY_SPREAD:
        out.append({"kind": "noisy_repeats",
                    "message": f"repeat times differ by up to {spread:.2f}x: medians reported"})
    for bound in bounds or []:
        if bound["ratio"] is not None and bound["ratio"] > bound["bound"] * BOUND_TOLERANCE:
            out.append({"kind": "above_bound",
                        "message": f"{bound['what']} = {bound['ratio']:.2f}x exceeds its analytic bound "
                                   f"{bound['bound']:.2f}x ({bound['why']}): the measurement is wrong, most likely "
                                   "disturbed by load"})
    return out
