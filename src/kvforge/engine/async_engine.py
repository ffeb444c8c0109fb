"""`AsyncEngine`: one background thread steps an `LLMEngine`; asyncio code (the server)
submits requests and awaits each request's outputs on its own queue.

Threading rule: only the engine thread touches the `LLMEngine` (its scheduler, cache and
model). Other threads hand it commands (add, abort) through a locked list and wake it;
it applies them between steps, so an abort frees the request's cache before the next step
runs. Outputs go back to the event loop of the coroutine that submitted the request with
`call_soon_threadsafe`, one call per step.

Invariants:
- the loop steps while any request is unfinished and sleeps otherwise (no busy wait);
- a request whose consumer stops listening (client gone, `aclose`) is aborted;
- an exception inside a step fails the requests of that step's engine alone: they are
  aborted and get the error, and the loop keeps serving new requests;
- after `shutdown()` no request is accepted and every request in flight finishes with
  reason "abort".
- a server builds its model on the engine thread (`build_on_engine_thread`), so one OS
  thread runs every torch operation: on a CPU each thread that runs a parallel operation
  keeps its own OpenMP team alive, and once the teams hold more threads than there are
  cores, libgomp shortens its spin-wait and each parallel region pays a futex wake-up
  (docs/benchmarks.md measures the cost).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import KVForgeError

logger = logging.getLogger(__name__)


class EngineUnavailableError(KVForgeError):
    """The engine is shutting down or its thread has stopped: no new request is accepted."""


class EngineStepError(KVForgeError):
    """A step of the engine raised; the requests in flight at that moment were aborted."""


# Called in the engine thread after each round of commands and step: (engine, the outputs
# of the round (steps and aborts), seconds of the step or None when no step ran).
StepObserver = Callable[[LLMEngine, Sequence[RequestOutput], float | None], None]

Built = TypeVar("Built")


@dataclass
class _Stream:
    """Where one request's outputs go: a queue owned by the submitting event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    stream: _Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ResetPrefixCache:
    """Forget every cached prefix (kept sequences, snapshots, cached pages); `done` is set
    in the engine thread once it has."""

    done: threading.Event


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._lock = threading.Lock()
        self._commands: list[_Add | _Abort | _ResetPrefixCache] = []
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None

    @classmethod
    def build_on_engine_thread(cls, build: Callable[[], Built], engine_of: Callable[[Built], LLMEngine],
                               observer: StepObserver | None = None) -> tuple[AsyncEngine, Built]:
        """Start the engine thread, run `build()` (the model's loading and warm-up) on it,
        then step there: returns once built, with the thread running (`start()` is then a
        no-op). An exception of `build` is raised here, in the caller's thread."""
        built: Future[tuple[AsyncEngine, Built]] = Future()

        def main() -> None:
            try:
                value = build()
                engine = cls(engine_of(value), observer)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                built.set_exception(exc)
                return
            engine._thread = threading.current_thread()
            built.set_result((engine, value))
            engine._run()

        threading.Thread(target=main, name="kvforge-engine", daemon=True).start()
        return built.result()

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """Running and not shutting down: `generate` would take a request now."""
        return self._accepting and self.is_running

    def shutdown(self) -> None:
        """Refuse new requests and abort every request in flight (their streams end with
        finish_reason "abort"). Safe from any thread, signal handlers included."""
        with self._lock:
            self._accepting = False
            self._commands.append(_Abort(_ALL))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """`shutdown()`, then end the engine thread once it has applied the aborts."""
        self.shutdown()
        with self._lock:
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- requests ---------------------------------------------------------------------
    async def generate(self, prompt: Sequence[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as the engine produces them (each holds
        the step's delta and everything so far), the finished one last. Raises
        ConfigError from the engine for a request that cannot run, and aborts the request
        when the caller stops iterating early."""
        stream = _Stream(asyncio.get_running_loop())
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        with self._lock:
            if not self.accepting:
                raise EngineUnavailableError("the engine is not accepting requests (shutting down)")
            self._commands.append(_Add(request_id, list(prompt), params, arrival, stream))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); applied before the engine's next step."""
        with self._lock:
            self._commands.append(_Abort(request_id))
        self._wake.set()

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """Free what the prefix cache holds for later requests (between the engine's steps,
        never under a running request); False if the engine did not get to it in time."""
        done = threading.Event()
        with self._lock:
            self._commands.append(_ResetPrefixCache(done))
        self._wake.set()
        return await asyncio.to_thread(done.wait, timeout)

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                commands, self._commands = self._commands, []
                idle = not commands and not self.engine.has_unfinished_requests()
                if idle and self._stop:
                    return
                if idle:
                    self._wake.clear()
            if idle:
                self._wake.wait()
                continue
            deliveries: list[tuple[_Stream, Any]] = []
            for command in commands:
                deliveries.extend(self._apply(command))
            seconds = None
            if self.engine.has_unfinished_requests():
                start = time.perf_counter()
                deliveries.extend(self._step())
                seconds = time.perf_counter() - start
            self._observe([item for _, item in deliveries if isinstance(item, RequestOutput)], seconds)
            self._deliver(deliveries)

    def _apply(self, command: _Add | _Abort | _ResetPrefixCache) -> list[tuple[_Stream, Any]]:
        if isinstance(command, _ResetPrefixCache):
            self.engine.clear_prefix_cache()
            command.done.set()
            return []
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.prompt, command.params, command.request_id, command.arrival_time)
            except Exception as exc:  # noqa: BLE001 - the submitter gets the reason
                return [(command.stream, exc)]
            self._streams[command.request_id] = command.stream
            return []
        ids = list(self._streams) if command.request_id == _ALL else [command.request_id]
        out = []
        for output in self.engine.abort_request(ids):
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                out.append((stream, output))
        for request_id in ids:  # a request that finished in the same step as its abort
            self._streams.pop(request_id, None)
        return out

    def _observe(self, outputs: list[RequestOutput], seconds: float | None) -> None:
        if self.observer is None:
            return
        try:
            self.observer(self.engine, outputs, seconds)
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            logger.exception("step observer failed")

    def _step(self) -> list[tuple[_Stream, Any]]:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one failed step must not stop the server
            logger.exception("engine step failed; aborting the requests in flight")
            return self._fail_all(exc)
        out = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            out.append((stream, output))
        return out

    def _fail_all(self, exc: Exception) -> list[tuple[_Stream, Any]]:
        ids = list(self._streams)
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001
            logger.exception("abort after a failed step failed too")
        error = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
        return [(self._streams.pop(request_id), error) for request_id in ids]

    @staticmethod
    def _deliver(deliveries: list[tuple[_Stream, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed (server shutting down): nobody listens
                pass


_ALL = "\0all"  # abort every request in flight


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
