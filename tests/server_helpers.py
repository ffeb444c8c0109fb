"""A tiny random Llama with a real (character-level) Hugging Face tokenizer and chat
template, served by `kvforge serve`'s app on a free loopback port in a background thread."""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import transformers
import uvicorn
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from kvforge.cache.registry import create_cache
from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.registry import build_model
from kvforge.serve.app import create_app
from kvforge.serve.metrics import ServerMetrics
from kvforge.serve.served_model import ServedModel
from kvforge.tools.bench.serve_server import free_loopback_port as free_port  # noqa: F401 (re-exported)

MODEL_NAME = "tiny"
VOCAB = 128
CONTEXT = 512
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One id per printable ASCII character or newline; <unk>=0, <s>=1, </s>=2 (EOS)."""
    chars = ["\n", *(c for c in string.printable if c.isprintable())]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_model(seed: int = 0, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    hf_config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                                         max_position_embeddings=CONTEXT, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = build_model(config_from_hf_dict(hf_config.to_dict()), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.3)
    return model.eval()


def make_engine(model: torch.nn.Module, tokenizer, budget: int = 1 << 22, cache: str = "full:block_size=8",
                batched_tokens: int = 64, max_num_seqs: int = 256, step_timing: bool = False) -> LLMEngine:
    kv = create_cache(cache, model.cache_layout(), budget, torch.float32)
    config = EngineConfig(budget, max_num_batched_tokens=batched_tokens, max_num_seqs=max_num_seqs,
                          step_timing=step_timing)
    return LLMEngine(model, kv, tokenizer, config)


@dataclass
class RunningServer:
    base_url: str
    engine: AsyncEngine
    metrics: ServerMetrics

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine.engine


@contextmanager
def serve(engine: LLMEngine, tokenizer, api_key: str | None = None) -> Iterator[RunningServer]:
    """The app on 127.0.0.1:<free port> in a thread, stopped on exit."""
    metrics = ServerMetrics(MODEL_NAME)
    async_engine = AsyncEngine(engine, metrics.observe_step)
    app = create_app(ServedModel(MODEL_NAME, async_engine, tokenizer), metrics, api_key)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", async_engine, metrics)
    finally:
        server.should_exit = True
        thread.join(30)


# Module-scoped fixtures shared by the engine and server tests: a test module imports them
# (`from server_helpers import model_fixture, tokenizer_fixture`, marked as an unused
# import for the linter) and its tests ask for `tokenizer` and `model`.
@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture() -> transformers.PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="module", name="model")
def model_fixture() -> Iterator[torch.nn.Module]:
    """The tiny model, built on one thread (its weights then match every test's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model()
    torch.set_num_threads(threads)
