"""uvicorn's Server with kvforge's shutdown: a signal stops accepting, aborts the requests
in flight (their streams end at once instead of running to max_tokens) and, unlike
uvicorn's own handler, is not re-raised after shutdown, so the process exits 0."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn

from kvforge.engine.async_engine import AsyncEngine


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.engine.shutdown()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        else:
            self.should_exit = True
