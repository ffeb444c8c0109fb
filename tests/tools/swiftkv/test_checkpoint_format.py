"""What a written SwiftKV checkpoint states, beyond loading back: the HF conventions
(a tied head is not stored, `torch_dtype` is the written dtype, `architectures` and
`model_type` name the family's layout), the params-only marks, and the checks that refuse
a wrong checkpoint before any weight is read: an overlay over another network shape, a
base model that is itself a SwiftKV model, an export of a checkpoint that lacks a SwiftKV
tensor."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import make_pair
from safetensors.torch import load_file
from swiftkv_helpers import gemma3_across_kv_pair

from kvforge.cli import main
from kvforge.config import SwiftKVConfig
from kvforge.errors import ModelLoadError
from kvforge.models.loader import load_model
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import (
    BASE_MODEL_KEY,
    PARAMS_ONLY_KEY,
    base_model_of,
    hf_config_dict,
    initial_swiftkv_tensors,
    is_params_only,
    overlay_config,
    write_checkpoint,
)
from kvforge.tools.swiftkv.export import export_full_checkpoint


def base_and_swiftkv():
    """A 5-layer base llama with random weights and the SwiftKV setting l = 1, g = 2."""
    config = replace(make_pair("llama_gqa")[1].config, num_layers=5, layer_types=())
    torch.manual_seed(0)
    base = build_model(config)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.2)
    return base, SwiftKVConfig(1, 2)


def write_full(directory, base, swift):
    state = dict(base.state_dict())
    state.update(initial_swiftkv_tensors(state, base.config, swift))
    write_checkpoint(directory, replace(base.config, swiftkv=swift), state, torch.float32)


@pytest.mark.parametrize(("arch", "stored"), [("smollm2_tied", False), ("llama_gqa", True)])
def test_a_tied_head_is_not_stored(tmp_path, arch, stored):
    model = make_pair(arch)[1]
    write_checkpoint(tmp_path / "ckpt", model.config, model.state_dict(), torch.float32)
    assert ("lm_head.weight" in load_file(str(tmp_path / "ckpt" / "model.safetensors"))) == stored


def test_torch_dtype_is_the_written_dtype(tmp_path):
    model = make_pair("llama_gqa")[1]
    write_checkpoint(tmp_path / "ckpt", model.config, model.state_dict(), torch.float16)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["torch_dtype"] == "float16"
    assert {t.dtype for t in load_file(str(tmp_path / "ckpt" / "model.safetensors")).values()} == {torch.float16}


def test_layout_names():
    base = make_pair("llama_gqa")[1].config
    plain = hf_config_dict(base)
    assert (plain["model_type"], plain["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert not {"swiftkv", "num_key_value_layers", "key_value_group_size", "early_exit_head"} & set(plain)
    swift = hf_config_dict(replace(base, swiftkv=SwiftKVConfig(1, 2, early_exit_head=True)))
    assert (swift["model_type"], swift["architectures"]) == ("llama_swiftkv", ["LlamaSwiftKVForCausalLM"])
    assert (swift["swiftkv"], swift["num_key_value_layers"], swift["key_value_group_size"],
            swift["early_exit_head"]) == (True, 1, 2, True)
    qwen2 = hf_config_dict(make_pair("qwen2_bias")[1].config)
    assert (qwen2["model_type"], qwen2["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])


def test_params_only_checkpoints_are_marked_and_full_ones_are_not(tmp_path):
    base, swift = base_and_swiftkv()
    tensors = initial_swiftkv_tensors(dict(base.state_dict()), base.config, swift)
    write_checkpoint(tmp_path / "params", replace(base.config, swiftkv=swift), tensors, torch.float32,
                     base_model="some-base")
    hf = json.loads((tmp_path / "params" / "config.json").read_text())
    assert (hf[PARAMS_ONLY_KEY], hf[BASE_MODEL_KEY]) == (True, "some-base")
    assert is_params_only(tmp_path / "params") and base_model_of(tmp_path / "params") == "some-base"
    write_full(tmp_path / "full", base, swift)
    hf = json.loads((tmp_path / "full" / "config.json").read_text())
    assert PARAMS_ONLY_KEY not in hf and BASE_MODEL_KEY not in hf
    assert not is_params_only(tmp_path / "full") and base_model_of(tmp_path / "full") is None


def test_an_overlay_over_another_network_shape_is_refused_by_field(tmp_path):
    model, swift = base_and_swiftkv()
    write_full(tmp_path / "swift", model, swift)
    base = model.config
    assert overlay_config(base, tmp_path / "swift").swiftkv == swift
    for field, value in (("num_kv_heads", 4), ("head_dim", 32), ("vocab_size", 95), ("intermediate_size", 64),
                         ("attention_bias", True)):
        with pytest.raises(ModelLoadError, match=f"has {field}=.* but the base model has {field}={value}"):
            overlay_config(replace(base, **{field: value}), tmp_path / "swift")
    write_checkpoint(tmp_path / "plain", base, model.state_dict(), torch.float32)
    with pytest.raises(ModelLoadError, match=r"not a SwiftKV checkpoint.*model_type 'llama'.*'gemma3_text_swiftkv'"):
        overlay_config(base, tmp_path / "plain")


def test_a_gemma3_across_kv_checkpoint_keeping_every_base_tensor_loads(tmp_path):
    """Non-leaders (layers 3 and 5 of l = 2, g = 2) read their leader's keys: the base k_norm
    a full checkpoint keeps for them is dropped, a leader's is its own."""
    base, model = gemma3_across_kv_pair()
    state = dict(base.state_dict())
    state.update(initial_swiftkv_tensors(state, base.config, model.config.swiftkv))
    write_checkpoint(tmp_path / "gemma3", model.config, state, torch.float32)
    loaded = load_model(tmp_path / "gemma3")[0].state_dict()
    assert not {"model.layers.3.self_attn.k_norm.weight", "model.layers.5.self_attn.k_norm.weight"} & set(loaded)
    for leader in (2, 4):
        name = f"model.layers.{leader}.self_attn.k_norm.weight"
        assert torch.equal(loaded[name], state[name])


def test_init_refuses_a_swiftkv_model_as_its_base(tmp_path, capsys):
    base, swift = base_and_swiftkv()
    write_full(tmp_path / "swift", base, swift)
    code = main(["swiftkv", "init", "--model", str(tmp_path / "swift"), "--num-key-value-layers", "1",
                 "--out", str(tmp_path / "again")])
    assert code == 2 and "must be a base model, not a SwiftKV checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_export_refuses_a_checkpoint_lacking_a_swiftkv_tensor(tmp_path):
    base, swift = base_and_swiftkv()
    write_checkpoint(tmp_path / "base", base.config, base.state_dict(), torch.float32)
    tensors = initial_swiftkv_tensors(dict(base.state_dict()), base.config, swift)
    del tensors["model.layers.3.self_attn.q_proj_swiftkv.weight"]
    write_checkpoint(tmp_path / "params", replace(base.config, swiftkv=swift), tensors, torch.float32,
                     base_model=str(tmp_path / "base"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 SwiftKV tensor.*model.layers.3.self_attn.q_proj_swiftkv.weight"):
        export_full_checkpoint(tmp_path / "params", tmp_path / "out", tokenizer=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelLoadError, match="model.layers.3.self_attn.q_proj_swiftkv.weight"):
        load_model(tmp_path / "params")
