"""The server loads its model on the engine thread, which then runs every step: one OS
thread runs torch. A second thread that has run a parallel operation keeps its own
OpenMP team, and with more OpenMP threads than cores libgomp stops spin-waiting, which
slowed every served step (docs/benchmarks.md, "One thread runs torch")."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

import kvforge.engine.llm as llm_module
from kvforge.cli import build_parser
from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError
from kvforge.serve.server import load_engine


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _serve_args(*extra: str):
    return build_parser(["serve"]).parse_args(["serve", "--model", "llama-tiny", "--load-format", "dummy", *extra])


def _generate(engine: AsyncEngine, prompt: list[int], tokens: int) -> list:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def collect() -> list:
        return [output async for output in engine.generate(prompt, params, "r0")]

    return asyncio.run(collect())


def test_the_server_builds_and_steps_its_model_on_one_thread_that_is_not_the_callers(monkeypatch):
    built_on: list[int] = []
    stepped_on: set[int] = set()

    class RecordingLLM(llm_module.LLM):
        def __init__(self, *args, **kwargs) -> None:
            built_on.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    step = LLMEngine.step

    def recording_step(self: LLMEngine):
        stepped_on.add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(llm_module, "LLM", RecordingLLM)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine, llm = load_engine(_serve_args())
    try:
        assert engine.is_running and engine.engine is llm.engine
        outputs = _generate(engine, [5, 6, 7], tokens=3)
    finally:
        engine.stop()
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 3
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()
    assert stepped_on == set(built_on)


def test_start_after_a_build_keeps_the_one_engine_thread():
    engine, _ = AsyncEngine.build_on_engine_thread(lambda: llm_module.LLM("llama-tiny", load_format="dummy"),
                                                   lambda llm: llm.engine)
    try:
        thread = engine._thread
        engine.start()
        assert engine._thread is thread and thread.name == "kvforge-engine"
        assert _generate(engine, [4, 5], tokens=2)[-1].finished
    finally:
        engine.stop()
    assert not thread.is_alive()


def test_a_build_that_fails_raises_its_error_in_the_caller_and_ends_the_thread():
    def fail() -> None:
        raise ConfigError("kv_budget", "1B", "must hold one page")

    before = {thread.ident for thread in threading.enumerate()}
    with pytest.raises(ConfigError, match="kv_budget"):
        AsyncEngine.build_on_engine_thread(fail, lambda built: built)
    for thread in threading.enumerate():
        if thread.ident not in before and thread.name == "kvforge-engine":
            thread.join(5)
            assert not thread.is_alive()


_INTERRUPTED_LOAD = """
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
import kvforge.engine.llm as llm_module
from kvforge.cli import build_parser
from kvforge.serve.server import load_engine

class SlowLLM:
    def __init__(self, *args, **kwargs):
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(30)

llm_module.LLM = SlowLLM
load_engine(build_parser(["serve"]).parse_args(["serve", "--model", "llama-tiny", "--load-format", "dummy"]))
print("load_engine returned")
"""


def test_ctrl_c_while_the_engine_thread_loads_ends_the_server_at_once():
    import subprocess
    import sys

    from kvforge.serve.server import INTERRUPTED_EXIT_CODE

    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_LOAD], capture_output=True, text=True, timeout=25)
    assert done.returncode == INTERRUPTED_EXIT_CODE, done.stderr
    assert "interrupted while loading the model" in done.stderr and "load_engine returned" not in done.stdout
