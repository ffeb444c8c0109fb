"""Fixtures of the bench tests."""

from __future__ import annotations

import pytest
from server_helpers import char_tokenizer

from kvforge.models.hf_config import config_from_hf_dict
from kvforge.tools.bench import serve as bench_serve


@pytest.fixture
def tiny_sources(monkeypatch):
    """The bench's model lookups answered by the tiny model's tokenizer and config."""
    tokenizer = char_tokenizer()
    config = config_from_hf_dict({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
                                       "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "num_hidden_layers": 2, "max_position_embeddings": 512})
    monkeypatch.setattr(bench_serve, "resolve_model_source", lambda name: name)
    monkeypatch.setattr(bench_serve, "load_model_config", lambda source: config)
    monkeypatch.setattr(bench_serve, "heldout_text", lambda path: "a held-out text. " * 200)
    monkeypatch.setattr("kvforge.models.tokenizer.load_tokenizer", lambda source: tokenizer)
    return tokenizer
