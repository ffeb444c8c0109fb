"""A Llama-style tokenizer llguidance can read (leading-space marker, byte fallback for any
other character) and a tiny random model over its vocabulary: what the structured-output
tests run on (the character tokenizer of server_helpers has a decoder llguidance does not
read)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers
from fastapi.testclient import TestClient
from server_helpers import CHAT_TEMPLATE, MODEL_NAME, make_engine, tiny_model
from tokenizers import Tokenizer, decoders, models, normalizers

from kvforge.engine.async_engine import AsyncEngine
from kvforge.serve.app import create_app
from kvforge.serve.served_model import ServedModel

WORDS = ["▁", *"abcdefghijklmnopqrstuvwxyz0123456789{}[]\":,-", "▁yes", "▁no", "ye", "yes", "no", "yellow",
         "true", "false", "null", "\"a\"", "\"b\""]
VOCAB = 320


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """<unk>=0, <s>=1, </s>=2 (EOS), the 256 byte tokens <0x00>..<0xFF>, then WORDS."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    assert len(vocab) <= VOCAB
    model = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(scope="module", name="model")
def byte_model_fixture() -> Iterator[torch.nn.Module]:
    """The tiny random Llama over byte_tokenizer's vocabulary, built on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model(vocab=VOCAB)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", name="client")
def byte_client_fixture(model: torch.nn.Module) -> Iterator[TestClient]:
    """The server's app in-process over that model and byte_tokenizer; server errors come
    back as 500 responses."""
    tokenizer = byte_tokenizer()
    app = create_app(ServedModel(MODEL_NAME, AsyncEngine(make_engine(model, tokenizer)), tokenizer))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client
