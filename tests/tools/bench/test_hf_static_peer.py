"""`hf-static`, transformers' static cache with its forward compiled: it gives the eager
peer's greedy tokens (float32, tiny size), compiling never lands in a timed region, and
only bench decode and bench prefill take it. The default suite swaps the compiled call for
the plain forward (the static-cache loop is what it checks); the slow test compiles with
inductor for real (on a CPU it needs a C++ compiler)."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from server_helpers import char_tokenizer, tiny_model

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.models.loader import resolve_model_source
from kvforge.models.swiftkv_checkpoint import write_checkpoint
from kvforge.tools.bench import hf_peer, hf_static_peer
from kvforge.tools.bench.compare import parse_compare
from kvforge.tools.verify import load_transformers_model

COMPILE_SECONDS = 0.5  # what the stand-in compile costs on its first call


def checkpoint(tmp_path):
    directory = tmp_path / "tiny"
    write_checkpoint(directory, tiny_model().config, dict(tiny_model().state_dict()), torch.float32)
    char_tokenizer().save_pretrained(str(directory))
    return directory


def transformers_model(tmp_path) -> torch.nn.Module:
    return load_transformers_model(resolve_model_source(str(checkpoint(tmp_path))), "cpu", torch.float32)


def eager_tokens(model: torch.nn.Module, prompts: list[list[int]], gen: int) -> torch.Tensor:
    """hf_peer's decode loop (dynamic cache, eager), keeping the tokens."""
    from transformers import DynamicCache

    from kvforge.integrations.transformers import cache_argument

    ids = torch.tensor(prompts)
    tokens = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        for _ in range(gen):
            out = model(input_ids=ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
            ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(ids)
    return torch.cat(tokens, dim=1)


@pytest.fixture
def slow_first_call(monkeypatch):
    """The compiled call replaced by the plain forward, whose first call sleeps as a compile would."""
    calls = []

    def stand_in(model):
        def call(**kwargs):
            if not calls:
                time.sleep(COMPILE_SECONDS)
            calls.append(kwargs["input_ids"].shape)
            return model(**kwargs)
        return call

    monkeypatch.setattr(hf_static_peer, "compiled_call", stand_in)
    return calls


PROMPTS = [[5, 17, 33, 9, 60, 2, 41, 7], [90, 3, 3, 12, 77, 101, 8, 19]]


def test_the_static_cache_loop_gives_the_eager_peers_tokens(tmp_path, slow_first_call):
    model = transformers_model(tmp_path)
    peer = hf_static_peer.StaticPeer(model, max_len=len(PROMPTS[0]) + 6)
    expected = eager_tokens(model, PROMPTS, 6)
    for _ in range(2):  # the cache is reset between runs
        tokens, _ = peer.decode_tokens(PROMPTS, 6)
        assert torch.equal(tokens, expected)
    assert set(slow_first_call) == {(2, 1)}  # the compiled call decodes; the prefill is the plain forward
    assert peer.decode(PROMPTS, 6)["tokens"] == hf_peer.decode(model, PROMPTS, 6)["tokens"] == 10


@pytest.mark.parametrize("benchmark", ["decode", "prefill"])
def test_compiling_is_reported_apart_and_never_timed(tmp_path, slow_first_call, benchmark):
    """With --warmup 0 the first timed run would pay the compile if the peer did not compile first."""
    out = tmp_path / "bench.json"
    sizes = ["--batch", "2", "--context", "8", "--gen", "4"] if benchmark == "decode" else ["--prompt-len", "8"]
    code = main(["bench", benchmark, "--model", str(checkpoint(tmp_path)), *sizes, "--compare", "hf,hf-static",
                 "--repeats", "2", "--warmup", "0", "--kv-budget", "4MiB", "--threads", "1", "--json", str(out)])
    assert code == 0
    systems = {s["name"]: s for s in json.loads(out.read_text())["systems"]}
    assert set(systems) == {"kvforge[full]", "hf", "hf-static"}
    static = systems["hf-static"]
    assert static["kind"] == "hf-static" and static["compile_seconds"] >= COMPILE_SECONDS
    assert max(static["seconds_all"]) < COMPILE_SECONDS
    assert "compile_seconds" not in systems["hf"]


def test_only_decode_and_prefill_take_the_static_peer(capsys):
    assert [(s.name, s.kind) for s in parse_compare("hf,hf-static", hf_static=True)] == [
        ("hf", "hf"), ("hf-static", "hf-static")]
    with pytest.raises(ConfigError, match="bench decode and bench prefill only"):
        parse_compare("hf-static")
    assert main(["bench", "throughput", "--compare", "hf-static"]) == 2
    assert "hf-static" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on a CPU needs a C++ compiler")
def test_compiled_static_decode_and_prefill_match_the_eager_peer(tmp_path):
    """For real: inductor compiles the decode step and the prefill (tens of seconds on a cold
    compile cache), and the greedy tokens and the prefill's argmax are the eager peer's."""
    model = transformers_model(tmp_path)
    peer = hf_static_peer.StaticPeer(model, max_len=len(PROMPTS[0]) + 6)
    assert peer.compile_decode(PROMPTS, 6) > 0
    tokens, _ = peer.decode_tokens(PROMPTS, 6)
    assert torch.equal(tokens, eager_tokens(model, PROMPTS, 6))
    prefill_peer = hf_static_peer.StaticPeer(model, max_len=len(PROMPTS[0]))
    prefill_peer.compile_prefill(PROMPTS)
    with torch.inference_mode():
        prefill_peer.cache.reset()
        first = prefill_peer._forward(prefill_peer.call, torch.tensor(PROMPTS))
    assert torch.equal(first, eager_tokens(model, PROMPTS, 1))
