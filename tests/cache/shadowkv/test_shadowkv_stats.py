"""ShadowKV's phase timers: always on the CPU; on CUDA only while engine step timing
records, and then they synchronise the device before and after each phase, so they time
the device's work rather than kernel launches (torch.cuda.synchronize is recorded here:
there is no GPU)."""

from __future__ import annotations

import time

import torch

from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.step_timing import StepTimer, recording


def _sleep_in(stats: ShadowKVStats, phase: str) -> None:
    with stats.timed(phase):
        time.sleep(0.002)


def test_cpu_phases_are_always_timed_without_synchronising(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    stats = ShadowKVStats()
    _sleep_in(stats, "fetch")
    assert stats.seconds["fetch"] >= 0.002 and calls == []


def test_cuda_phases_synchronise_only_under_step_timing(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    stats = ShadowKVStats(device_type="cuda")
    _sleep_in(stats, "rebuild")
    assert stats.seconds["rebuild"] == 0.0 and calls == []  # timing off: no synchronisation
    with recording(StepTimer("cpu")):
        _sleep_in(stats, "rebuild")
    assert stats.seconds["rebuild"] >= 0.002 and calls == ["sync", "sync"]
    stats.reset()
    assert stats.device_type == "cuda" and stats.seconds["rebuild"] == 0.0
