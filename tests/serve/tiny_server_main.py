"""`python serve/tiny_server_main.py PORT` (run from tests/): the tiny model served by kvforge's GracefulServer in the
main thread, as `kvforge serve` runs it (signals included)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: server_helpers
from server_helpers import MODEL_NAME, char_tokenizer, make_engine, tiny_model

from kvforge.engine.async_engine import AsyncEngine
from kvforge.serve.app import create_app
from kvforge.serve.graceful import GracefulServer
from kvforge.serve.metrics import ServerMetrics
from kvforge.serve.served_model import ServedModel

if __name__ == "__main__":
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    metrics = ServerMetrics(MODEL_NAME)
    engine = AsyncEngine(make_engine(tiny_model(), tokenizer), metrics.observe_step)
    app = create_app(ServedModel(MODEL_NAME, engine, tokenizer), metrics)
    config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    GracefulServer(config, engine).run()
    print("server exited cleanly", flush=True)
