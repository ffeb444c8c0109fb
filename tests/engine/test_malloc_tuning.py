"""glibc's malloc keeps freed memory for reuse on CPU engines (fewer page faults a step),
unless the user says otherwise; the start-up log says which."""

from __future__ import annotations

import pytest

import kvforge.malloc_tuning as malloc_tuning
from kvforge.engine.llm import LLM


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, int]]:
    """A fresh process's state, with mallopt recorded instead of called."""
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(malloc_tuning, "_outcome", None)
    monkeypatch.setattr(malloc_tuning, "_mallopt", lambda: lambda option, value: seen.append((option, value)) or 1)
    monkeypatch.delenv(malloc_tuning.ENV_SWITCH, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    return seen


def test_sets_both_thresholds_once_per_process(calls):
    first = malloc_tuning.keep_freed_memory()
    assert malloc_tuning.keep_freed_memory() == first and "kept for reuse" in first
    assert calls == [(malloc_tuning.M_MMAP_THRESHOLD, 32 * 2**20), (malloc_tuning.M_TRIM_THRESHOLD, 2**30)]


@pytest.mark.parametrize("value", ["off", "0", "OFF"])
def test_the_switch_leaves_glibcs_defaults(calls, monkeypatch, value):
    monkeypatch.setenv(malloc_tuning.ENV_SWITCH, value)
    assert "glibc's defaults" in malloc_tuning.keep_freed_memory() and calls == []


def test_the_users_glibc_tunables_win(calls, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert "GLIBC_TUNABLES" in malloc_tuning.keep_freed_memory() and calls == []


def test_a_refused_threshold_is_reported(calls, monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_mallopt", lambda: lambda option, value: 0)
    assert "refused" in malloc_tuning.keep_freed_memory()


def test_glibc_here_offers_mallopt():
    assert malloc_tuning._mallopt() is not None


def test_a_cpu_engine_applies_it_and_says_so_at_start_up(calls):
    llm = LLM("llama-tiny", load_format="dummy")
    assert len(calls) == 2
    assert any(line.startswith("malloc: freed blocks up to 32 MiB kept for reuse") for line in llm.start_up_lines())
