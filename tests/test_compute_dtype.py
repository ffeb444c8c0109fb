"""`--dtype auto`: bfloat16 on a CPU with bf16 hardware, float32 elsewhere, and a reason to print."""

from __future__ import annotations

import pytest
import torch

from kvforge.compute_dtype import ENV_OVERRIDE, bf16_cpu_feature, resolve_dtype


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)


@pytest.mark.parametrize(("flags", "expected", "feature"), [
    ({"avx512f", "avx512_bf16"}, "bfloat16", "AVX-512 BF16"),
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, "bfloat16", "AMX-BF16"),
    ({"avx2", "avx512f"}, "float32", None),
    (set(), "float32", None),
])
def test_auto_follows_the_cpu(unpinned, flags, expected, feature):
    dtype, reason = resolve_dtype("auto", "cpu", flags)
    assert dtype == expected and bf16_cpu_feature(flags) == feature
    assert reason.startswith(f"--dtype auto: {expected}")
    if feature:
        assert feature in reason and "--dtype float32" in reason


def test_none_is_auto_and_a_named_dtype_is_kept(unpinned):
    assert resolve_dtype(None, "cpu", {"avx512_bf16"})[0] == "bfloat16"
    assert resolve_dtype("AUTO", "cpu", {"avx512_bf16"})[0] == "bfloat16"
    assert resolve_dtype("float32", "cpu", {"avx512_bf16"}) == ("float32", None)
    assert resolve_dtype(torch.float16, "cpu", {"avx512_bf16"}) == (torch.float16, None)


def test_other_devices_stay_float32(unpinned):
    dtype, reason = resolve_dtype("auto", "meta", {"avx512_bf16"})
    assert dtype == "float32" and "--dtype bfloat16" in reason


def test_the_override_wins(monkeypatch):
    monkeypatch.setenv(ENV_OVERRIDE, "float16")
    assert resolve_dtype("auto", "cpu", {"avx512_bf16"})[0] == "float16"


def test_llm_reports_what_auto_picked(monkeypatch):
    from kvforge.engine.llm import LLM

    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    monkeypatch.setattr("kvforge.compute_dtype.cpu_flags", lambda: {"avx512_bf16"})
    llm = LLM("smollm2-135m", kv_budget="32MiB")
    assert llm.dtype == torch.bfloat16 and "AVX-512 BF16" in llm.dtype_reason
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr("kvforge.compute_dtype.cpu_flags", lambda: set())
    assert LLM("smollm2-135m", kv_budget="32MiB").dtype == torch.float32


def test_bfloat16_stays_float32_equal_enough():
    """What `auto` may pick must keep the model: on held-out passages of the shipped model,
    bfloat16's greedy choice (plain argmax of its float32 logits, which do not tie) is
    float32's at >= 97% of the positions, and their next-token distributions are close
    (KL < 0.01 nats). Logits rounded to bf16 agreed less (docs/benchmarks.md, 'Float32 logits
    and one verdict per machine')."""
    from kvforge.models.dense import dense_logits
    from kvforge.models.loader import load_model
    from kvforge.models.tokenizer import load_tokenizer
    from kvforge.tools.text_data import heldout_text

    full, source = load_model("smollm2-135m", dtype="float32")
    half, _ = load_model("smollm2-135m", dtype="bfloat16")
    ids = load_tokenizer(source).encode(heldout_text(None))
    for start in (0, 20_000):
        passage = torch.tensor([ids[start:start + 256]])
        with torch.inference_mode():
            reference, low = dense_logits(full, passage)[0].float(), dense_logits(half, passage)[0].float()
        assert low.argmax(-1).eq(reference.argmax(-1)).float().mean() >= 0.97
        kl = torch.nn.functional.kl_div(low.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                        reduction="batchmean")
        assert kl.item() < 0.01
