"""The tiny model's server in its own process (tests/serve/tiny_server_main.py), started
as `kvforge bench soak` starts `kvforge serve`, and the soak's model lookups answered by
the tiny model's tokenizer and config."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import CONTEXT, MODEL_NAME, VOCAB, char_tokenizer, free_port

from kvforge.models.hf_config import config_from_hf_dict
from kvforge.tools.bench import soak
from kvforge.tools.bench.serve_server import ServerProcess

TESTS = Path(__file__).parents[2]


def start_tiny_server(args) -> ServerProcess:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvforge-soak-test-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, str(TESTS / "serve" / "tiny_server_main.py"), str(port)], cwd=TESTS,
                               stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = ServerProcess(f"http://127.0.0.1:{port}", process, Path(log.name))
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise AssertionError(f"the tiny server did not start:\n{tail}")
        time.sleep(0.1)


@pytest.fixture(name="tiny_soak")
def tiny_soak_fixture(monkeypatch):
    """`soak.run` on the tiny model's server; returns its tokenizer."""
    tokenizer = char_tokenizer()
    config = config_from_hf_dict({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
                                  "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "num_hidden_layers": 2, "max_position_embeddings": CONTEXT})
    monkeypatch.setattr(soak, "resolve_model_source", lambda name: name)
    monkeypatch.setattr(soak, "load_model_config", lambda source: config)
    monkeypatch.setattr(soak, "heldout_text", lambda path: "A held-out text, with words; and numbers 0123. " * 100)
    monkeypatch.setattr(soak, "start_server", start_tiny_server)
    monkeypatch.setattr(soak, "SERVED_NAME", MODEL_NAME)
    monkeypatch.setattr("kvforge.models.tokenizer.load_tokenizer", lambda source: tokenizer)
    return tokenizer
