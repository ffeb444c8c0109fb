"""The server's app in-process (FastAPI's TestClient: no socket, no thread of our own) on
the tiny model and character tokenizer of tests/server_helpers.py: a request costs
milliseconds, so generated bad bodies can be sent by the hundred. A test module imports
the fixture (`from in_process import app_client_fixture`, marked as an unused import for
the linter) and its tests ask for `app_client`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from server_helpers import MODEL_NAME, char_tokenizer, make_engine, tiny_model

from kvforge.engine.async_engine import AsyncEngine
from kvforge.serve.app import create_app
from kvforge.serve.served_model import ServedModel


@pytest.fixture(scope="module", name="app_client")
def app_client_fixture() -> Iterator[TestClient]:
    """The app with its engine loop started; server errors come back as 500 responses
    (never raised into the test), as a client would see them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    app = create_app(ServedModel(MODEL_NAME, AsyncEngine(make_engine(tiny_model(), tokenizer)), tokenizer))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    torch.set_num_threads(threads)
