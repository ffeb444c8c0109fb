"""SwiftKV beyond Llama: Gemma3 (Gemma norms, QK-norm, sliding and global later layers each
with their own window and RoPE, AcrossKV groups of one kind), Qwen2 (q/k/v biases) and
Mistral (every layer slides) against the dense reference, through every cache method."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_pair, make_runner
from swiftkv_helpers import GEMMA3_MIXED_TYPES, gemma3_across_kv_pair, qwen2_pair, swiftkv_model

from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import StepItem
from kvforge.errors import ConfigError
from kvforge.models.dense import dense_logits
from kvforge.models.gemma3_swiftkv import Gemma3SwiftKVForCausalLM
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.loader import load_model
from kvforge.models.swiftkv_checkpoint import hf_config_dict, initial_swiftkv_tensors, write_checkpoint

ATOL = 1e-4


def tokens_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def dense(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return dense_logits(model, torch.tensor([tokens]))[0]


def test_dense_reference_of_gemma3_is_transformers_gemma3():
    """The reference the Gemma3 SwiftKV tests lean on is right for the base model."""
    hf, base = make_pair("gemma3_hybrid")
    ids = torch.tensor([tokens_of(30, 1)])  # longer than the window of 10
    with torch.no_grad():
        torch.testing.assert_close(dense_logits(base, ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_gemma3_with_every_layer_keeping_its_kv_is_the_base_model():
    """Bit for bit the base model on the engine and the dense forward, and transformers'
    Gemma3ForCausalLM to rounding."""
    hf, base = make_pair("gemma3_hybrid")
    model = swiftkv_model(base, base.config.num_layers, 1)  # perturbed SwiftKV tensors: all unused
    assert isinstance(model, Gemma3SwiftKVForCausalLM)
    tokens = tokens_of(33, 1)
    torch.testing.assert_close(dense(model, tokens), dense(base, tokens), atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(dense(model, tokens), hf(torch.tensor([tokens])).logits[0], atol=1e-5, rtol=0)
    runner, base_runner = make_runner(model), make_runner(base)
    for chunk in (33, 5):
        for start in range(0, 33, chunk):
            piece = tokens[start:start + chunk]
            got = runner.step([StepItem(0, piece, len(piece))])
            torch.testing.assert_close(got, base_runner.step([StepItem(0, piece, len(piece))]), atol=0, rtol=0)
        runner.release(0)
        base_runner.release(0)


def test_gemma3_initialisation_follows_the_authors():
    """norm_swiftkv is layer l's (1 + w) input norm, q/k/v_proj_swiftkv the originals, a
    leader's K/V the mean over its group; the group's keys use the leader's k_norm."""
    base, model = gemma3_across_kv_pair()
    state = base.state_dict()
    tensors = initial_swiftkv_tensors(state, base.config, SwiftKVConfig(2, 2))
    assert torch.equal(tensors["model.norm_swiftkv.weight"], state["model.layers.2.input_layernorm.weight"])
    assert torch.equal(tensors["model.layers.5.self_attn.q_proj_swiftkv.weight"],
                       state["model.layers.5.self_attn.q_proj.weight"])
    mean = (state["model.layers.4.self_attn.k_proj.weight"] + state["model.layers.5.self_attn.k_proj.weight"]) / 2
    torch.testing.assert_close(tensors["model.layers.4.self_attn.k_proj_swiftkv.weight"], mean)
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.4.self_attn.k_norm.weight" in names and "model.layers.5.self_attn.q_norm.weight" in names
    assert "model.layers.5.self_attn.k_norm.weight" not in names  # a non-leader's keys are its leader's


# (model builder, description): the later layers of each mix what the family allows.
def _gemma3_single_input():
    return swiftkv_model(make_pair("gemma3_hybrid")[1], 1, 1)  # later layers: global, sliding, global


MODELS = {
    "gemma3_l1_g1": _gemma3_single_input,
    "gemma3_l2_g2_mixed": lambda: gemma3_across_kv_pair(2)[1],
    "qwen2_l1_g2": lambda: swiftkv_model(qwen2_pair(3)[1], 1, 2),
    "mistral_l1_g1": lambda: swiftkv_model(make_pair("mistral_window")[1], 1, 1),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("chunk", [40, 7, 1])
def test_skipping_forward_matches_dense_reference(name, chunk):
    model = MODELS[name]()
    tokens = tokens_of(40, 2)  # longer than every window (Gemma3 10, Mistral 12)
    expected = dense(model, tokens)
    runner = make_runner(model)
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        logits = runner.step([StepItem(0, piece)])
        torch.testing.assert_close(logits[0], expected[start + len(piece) - 1], atol=ATOL, rtol=0)


def _exact_cache_spec(method: str, model) -> str:
    """Settings under which each method attends exactly (so it must equal the dense reference):
    KIVI with a residual longer than any sequence, ShadowKV at full rank with a budget
    covering every chunk (sequences from 24 tokens are compressed)."""
    layout = model.cache_layout()
    return {"full": "full:block_size=4",
            "kivi": "kivi:bits=8,group=8,residual=64,residual_dtype=float32",
            "shadowkv": "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8,"
                        f"rank={layout.num_kv_heads * layout.head_dim},budget=128,coefficient_dtype=compute"}[method]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("method", ["full", "kivi", "shadowkv"])
def test_every_cache_method_decodes_the_dense_reference(name, method):
    """Two prompts prefilled together, then batched decode steps (ShadowKV decodes the
    37-token one compressed, with folds of generated tokens)."""
    model = MODELS[name]()
    prompts = [tokens_of(37, 3), tokens_of(29, 4)]
    generated = [tokens_of(14, 5), tokens_of(14, 6)]
    runner = make_runner(model, cache=_exact_cache_spec(method, model))
    first = runner.step([StepItem(seq, prompt) for seq, prompt in enumerate(prompts)])
    rows = [first] + [runner.step([StepItem(seq, [generated[seq][t]]) for seq in range(2)]) for t in range(14)]
    for seq in range(2):
        expected = dense(model, prompts[seq] + generated[seq])[len(prompts[seq]) - 1:]
        torch.testing.assert_close(torch.stack([r[seq] for r in rows]), expected, atol=ATOL, rtol=0)
    has_global = not all(model.config.is_sliding(i) for i in range(model.config.num_layers))
    if method == "shadowkv" and has_global:  # ShadowKV compresses global layers (Mistral has none)
        assert runner.cache.stats.compressions >= 1  # the compressed path ran, not only the exact one


def test_an_across_kv_group_mixing_sliding_and_global_layers_is_refused():
    config = make_pair("gemma3_hybrid")[1].config  # sliding, global, sliding, global
    with pytest.raises(ConfigError, match=r"key_value_group_size=2.*must not mix sliding-window and global"
                                          r".*layers 2\.\.3"):
        replace(config, swiftkv=SwiftKVConfig(2, 2))
    replace(config, swiftkv=SwiftKVConfig(2, 1))  # one layer per group: each keeps its own kind


def test_gemma3_checkpoint_loads_back_identical(tmp_path):
    """Written as `gemma3_text_swiftkv` (the Gemma3 config with the SwiftKV fields); read back
    to the same config, tensors (a non-leader has no k_norm) and logits."""
    _, model = gemma3_across_kv_pair()
    hf = hf_config_dict(model.config)
    assert (hf["model_type"], hf["architectures"]) == ("gemma3_text_swiftkv", ["Gemma3SwiftKVForCausalLM"])
    assert hf["layer_types"] == list(GEMMA3_MIXED_TYPES) and hf["rope_local_base_freq"] == 10000.0
    assert config_from_hf_dict(hf) == replace(model.config, model_type="gemma3_text_swiftkv")
    write_checkpoint(tmp_path / "gemma3", model.config, model.state_dict(), torch.float32)
    loaded, _ = load_model(tmp_path / "gemma3")
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = tokens_of(25, 8)
    torch.testing.assert_close(dense(loaded, tokens), dense(model, tokens), atol=0, rtol=0)
