"""The evaluation context loads the tokenizer of a model file once per process: an
evaluation reads it alone first (to build and check its prompts), then with the weights."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import make_pair

from kvforge.models.loader import ModelSource
from kvforge.tools.eval import context


def test_the_tokenizer_is_read_once_for_the_prompts_and_the_model(monkeypatch):
    source = ModelSource("gguf", Path("/models/tiny.gguf"), "tiny")
    model = make_pair("llama_gqa")[1]
    reads: list[ModelSource] = []
    monkeypatch.setattr(context, "_tokenizers", {})
    monkeypatch.setattr(context, "load_tokenizer", lambda s: reads.append(s) or object())
    monkeypatch.setattr(context, "resolve_model_source", lambda name: source)
    monkeypatch.setattr(context, "load_model", lambda name, dtype, swiftkv=None, device="cpu": (model, source))
    ctx = context.EvalContext("tiny", torch.float32, 1 << 20)
    first = ctx.tokenizer
    assert ctx.kvforge()[1] is first and ctx.tokenizer is first
    assert reads == [source]
    other = ModelSource("gguf", Path("/models/other.gguf"), "other")
    monkeypatch.setattr(context, "load_model", lambda name, dtype, swiftkv=None, device="cpu": (model, other))
    assert context.load_kvforge("other", torch.float32)[1] is not first and reads == [source, other]
