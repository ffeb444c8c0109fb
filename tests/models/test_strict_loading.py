"""Loading refuses any checkpoint whose tensors do not match the model exactly, and names
the tensor: each parameter left out in turn, an unexpected tensor added, each shape changed
in turn; for every family, tied and untied heads, and a SwiftKV model. A tied head that the
checkpoint stores anyway loads, as the embedding it is."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import across_kv_model, make_pair

from kvforge.errors import ConfigError, ModelLoadError
from kvforge.models.loader import load_model
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import write_checkpoint

ARCHS = ("llama_gqa", "smollm2_tied", "qwen2_bias", "gemma3_hybrid", "swiftkv")


def model_of(arch: str):
    return across_kv_model() if arch == "swiftkv" else make_pair(arch)[1]


def checkpoint_of(model) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` holds: every parameter once (a tied head is the embedding)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def refused(model, state: dict[str, torch.Tensor], *named: str) -> None:
    with pytest.raises(ModelLoadError) as error:
        build_model(model.config).load_hf_state_dict(state)
    for text in named:
        assert text in str(error.value), (text, str(error.value))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_missing_tensor_is_named(arch):
    model = model_of(arch)
    state = checkpoint_of(model)
    for name in state:
        refused(model, {k: v for k, v in state.items() if k != name}, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tensor_of_another_shape_is_named_with_both_shapes(arch):
    model = model_of(arch)
    state = checkpoint_of(model)
    for name, tensor in state.items():
        wrong = torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])
        refused(model, {**state, name: wrong}, name, str(tuple(wrong.shape)), str(tuple(tensor.shape)))


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unexpected_tensor_is_named(arch):
    model = model_of(arch)
    state = checkpoint_of(model)
    layers = model.config.num_layers
    for extra in (f"model.layers.{layers}.input_layernorm.weight", "model.layers.0.mlp.extra_proj.weight",
                  "model.layers.0.self_attn.q_proj.bias" if not model.config.attention_bias
                  else "model.layers.0.self_attn.o_proj.bias"):
        refused(model, {**state, extra: torch.zeros(4)}, extra)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_exact_checkpoint_loads_every_value(arch):
    model = model_of(arch)
    state = {name: torch.randn_like(t) for name, t in checkpoint_of(model).items()}
    fresh = build_model(model.config)
    fresh.load_hf_state_dict(state)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, state[name]), name


def test_a_tied_head_stored_anyway_loads_as_the_embedding():
    model = make_pair("smollm2_tied")[1]
    state = checkpoint_of(model)
    assert "lm_head.weight" not in state
    fresh = build_model(model.config)
    fresh.load_hf_state_dict({**state, "lm_head.weight": torch.randn_like(state["model.embed_tokens.weight"])})
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, state["model.embed_tokens.weight"])


def test_an_untied_head_is_its_own_tensor():
    model = make_pair("llama_gqa")[1]
    state = {name: torch.randn_like(t) for name, t in checkpoint_of(model).items()}
    fresh = build_model(model.config)
    fresh.load_hf_state_dict(state)
    assert not torch.equal(fresh.lm_head.weight, fresh.model.embed_tokens.weight)
    assert torch.equal(fresh.lm_head.weight, state["lm_head.weight"])


def test_load_model_names_a_tensor_missing_from_a_checkpoint_directory(tmp_path):
    model = make_pair("qwen2_bias")[1]
    state = checkpoint_of(model)
    del state["model.layers.1.self_attn.k_proj.bias"]
    write_checkpoint(tmp_path / "ckpt", model.config, state, torch.float32)
    with pytest.raises(ModelLoadError, match=re.escape("model.layers.1.self_attn.k_proj.bias")):
        load_model(tmp_path / "ckpt")


def test_a_load_draws_no_random_weights_and_leaves_building_as_it_was(tmp_path, monkeypatch):
    """Loading a checkpoint (or drawing a dummy model) builds the model without initialising
    its linear and embedding weights, which the load overwrites, and every build after it
    (and after a refused one) initialises again."""
    import json
    from dataclasses import replace

    from safetensors.torch import save_file
    from torch import nn

    from kvforge.models.swiftkv_checkpoint import hf_config_dict

    calls: list[str] = []
    for cls in (nn.Linear, nn.Embedding):
        monkeypatch.setattr(cls, "reset_parameters",
                            lambda self, original=cls.reset_parameters: calls.append(type(self).__name__) or original(self))
    model = make_pair("llama_gqa")[1]
    save_file(checkpoint_of(model), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(model.config)))
    calls.clear()
    loaded, _ = load_model(str(tmp_path))
    load_model("llama-tiny", load_format="dummy")
    assert calls == []
    for (name, ours), (_, theirs) in zip(loaded.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    with pytest.raises(ConfigError):
        build_model(replace(model.config, architecture="NoSuchForCausalLM"), initialise=False)
    build_model(model.config)
    assert "Linear" in calls and "Embedding" in calls
