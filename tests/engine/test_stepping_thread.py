"""A CPU engine built on one thread and stepped on another says so once (two OpenMP teams
oversubscribe the cores, engine/stepping_thread.py); built and stepped on one thread, or
with teams that fit the cores, it says nothing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
import torch

from kvforge.engine import stepping_thread
from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
WARNING = "built on one thread and is stepped on another"


@pytest.fixture
def two_threads_on_two_cores(monkeypatch) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(stepping_thread, "usable_cores", lambda: 2)
    yield
    torch.set_num_threads(threads)


def _on_another_thread(fn) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


@pytest.mark.parametrize("threads, cores, oversubscribed", [(2, 2, True), (2, 3, True), (1, 2, False),
                                                            (4, 16, False), (8, 16, False)])
def test_two_teams_oversubscribe_when_they_hold_more_threads_than_cores(threads, cores, oversubscribed):
    assert stepping_thread.teams_oversubscribe(threads, cores) is oversubscribed


def test_stepping_on_another_thread_warns_once(two_threads_on_two_cores, caplog):
    llm = LLM("llama-tiny", load_format="dummy")
    with caplog.at_level(logging.WARNING, logger=stepping_thread.__name__):
        _on_another_thread(lambda: llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False))
        _on_another_thread(lambda: llm.generate([[4, 5, 6]], PARAMS, use_tqdm=False))
    (message,) = _warnings(caplog)
    assert "OpenMP team of 2 threads on 2 cores" in message and "build_on_engine_thread" in message


def test_built_and_stepped_on_one_thread_says_nothing(two_threads_on_two_cores, caplog):
    llm = LLM("llama-tiny", load_format="dummy")
    with caplog.at_level(logging.WARNING, logger=stepping_thread.__name__):
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
        _on_another_thread(lambda: llm.generate([[4, 5, 6]], PARAMS, use_tqdm=False))  # decided at the first step
    assert _warnings(caplog) == []


def test_teams_that_fit_the_cores_say_nothing(monkeypatch, caplog):
    monkeypatch.setattr(stepping_thread, "usable_cores", lambda: 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM("llama-tiny", load_format="dummy")
        with caplog.at_level(logging.WARNING, logger=stepping_thread.__name__):
            _on_another_thread(lambda: llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False))
    finally:
        torch.set_num_threads(threads)
    assert _warnings(caplog) == []
