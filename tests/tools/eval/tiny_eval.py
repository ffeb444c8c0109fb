"""Tiny stand-ins for the evaluation CLIs: a random-weight Llama pair (kvforge and
transformers share the weights) and a character tokenizer whose decode inverts encode."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair

from kvforge.models.loader import ModelSource
from kvforge.tools.eval import context

FIRST_CHAR, LAST_CHAR = 32, 124  # ' ' .. '|' -> ids 3 .. 95 (vocab 96 of the tiny models)


class CharTokenizer:
    """One id per character; BOS=1 (added by encode when `add_bos`), EOS=2."""

    bos_token_id = 1
    eos_token_id = 2
    chat_template = None

    def __init__(self, add_bos: bool = False) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) - FIRST_CHAR + 3 if FIRST_CHAR <= ord(c) <= LAST_CHAR else 3 for c in text]
        return ([self.bos_token_id] if add_special_tokens and self.add_bos else []) + ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - 3 + FIRST_CHAR) for i in ids if i >= 3)


@pytest.fixture
def tiny_models(monkeypatch):
    """Patch the evaluation loaders to the tiny llama_gqa pair; returns (hf, ours, tokenizer).
    Runs on one thread (tiny ops on a loaded machine wait on thread wake-ups otherwise) and
    restores the thread count, which the CLI's --threads changes, afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf, ours = make_pair("llama_gqa")
    tokenizer = CharTokenizer()
    source = ModelSource("hf_dir", __import__("pathlib").Path("tiny"), "tiny")
    monkeypatch.setattr(context, "load_kvforge", lambda name, dtype, device: (ours, tokenizer, source))
    monkeypatch.setattr(context, "load_hf", lambda source, dtype, device: hf)
    monkeypatch.setattr(context, "load_tokenizer_only", lambda name: tokenizer)
    monkeypatch.setattr(context.EvalContext, "context_length", lambda self: ours.config.max_position_embeddings)
    yield hf, ours, tokenizer
    torch.set_num_threads(threads)
