"""SwiftKV checkpoints: the published format loads and runs, `init` writes what the
authors' initialisation prescribes, and everything loads back to identical tensors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import make_pair, make_runner
from safetensors.torch import load_file, save_file
from swiftkv_helpers import swiftkv_model

from kvforge.cli import main
from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import StepItem
from kvforge.errors import ConfigError, ModelLoadError
from kvforge.models.dense import dense_logits
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.loader import load_model
from kvforge.models.swiftkv_checkpoint import (
    hf_config_dict,
    initial_swiftkv_tensors,
    regroup_swiftkv_tensors,
    swiftkv_tensor_names,
    write_checkpoint,
)

LAYERS, FIRST_LATER, GROUP = 5, 1, 2


def tiny_base():
    base = make_pair("llama_gqa")[1]
    return replace(base.config, num_layers=LAYERS, layer_types=())


def published_checkpoint(tmp_path, seed: int = 0):
    """A tiny checkpoint written the way the authors' models are: llama_swiftkv config,
    every original tensor kept, SwiftKV tensors on later layers / leaders, random values."""
    config = replace(tiny_base(), swiftkv=SwiftKVConfig(FIRST_LATER, GROUP))
    hf = hf_config_dict(config)
    generator = torch.Generator().manual_seed(seed)
    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (config.vocab_size, h), "model.norm_swiftkv.weight": (h,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if i >= FIRST_LATER:
            shapes[p + "self_attn.q_proj_swiftkv.weight"] = (q, h)
            if (i - FIRST_LATER) % GROUP == 0:
                shapes[p + "self_attn.k_proj_swiftkv.weight"] = (kv, h)
                shapes[p + "self_attn.v_proj_swiftkv.weight"] = (kv, h)
    tensors = {name: torch.randn(shape, generator=generator) * (0.1 if len(shape) == 1 else 0.2)
               + (1.0 if len(shape) == 1 else 0.0) for name, shape in shapes.items()}
    directory = tmp_path / "published"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory, config, tensors


def test_published_format_loads_and_runs(tmp_path):
    directory, config, tensors = published_checkpoint(tmp_path)
    hf = json.loads((directory / "config.json").read_text())
    assert hf["model_type"] == "llama_swiftkv" and hf["architectures"] == ["LlamaSwiftKVForCausalLM"]
    model, _ = load_model(directory)
    assert model.config.swiftkv == SwiftKVConfig(FIRST_LATER, GROUP)
    state = model.state_dict()
    for name in swiftkv_tensor_names(model.config):
        assert torch.equal(state[name], tensors[name]), name
    # later layers' original projections are ignored, not loaded
    assert not any(n.startswith(f"model.layers.{LAYERS - 1}.self_attn.q_proj.") for n in state)
    tokens = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = dense_logits(model, torch.tensor([tokens]))[0]
    runner = make_runner(model)
    logits = runner.step([StepItem(0, tokens[:13])])
    torch.testing.assert_close(logits[0], expected[12], atol=1e-4, rtol=0)
    for position in range(13, 20):
        torch.testing.assert_close(runner.step([StepItem(0, [tokens[position]])])[0], expected[position],
                                   atol=1e-4, rtol=0)


def test_missing_tensor_is_named(tmp_path):
    directory, _, tensors = published_checkpoint(tmp_path)
    del tensors[f"model.layers.{FIRST_LATER}.self_attn.k_proj_swiftkv.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"layers.{FIRST_LATER}.self_attn.k_proj_swiftkv.weight"):
        load_model(directory)


def test_initialisation_follows_the_authors():
    base = make_pair("llama_gqa")[1]
    state = base.state_dict()
    swift = SwiftKVConfig(1, 2)
    tensors = initial_swiftkv_tensors(state, base.config, swift)
    assert set(tensors) == set(swiftkv_tensor_names(replace(base.config, swiftkv=swift)))
    assert torch.equal(tensors["model.norm_swiftkv.weight"], state["model.layers.1.input_layernorm.weight"])
    assert torch.equal(tensors["model.layers.2.self_attn.q_proj_swiftkv.weight"],
                       state["model.layers.2.self_attn.q_proj.weight"])
    for kind in ("k_proj", "v_proj"):
        mean = (state[f"model.layers.1.self_attn.{kind}.weight"] + state[f"model.layers.2.self_attn.{kind}.weight"]) / 2
        torch.testing.assert_close(tensors[f"model.layers.1.self_attn.{kind}_swiftkv.weight"], mean)


def test_regrouping_averages_each_group_of_a_single_input_kv_model():
    """g = 1 tensors (each later layer its own K/V) -> g = 2: a leader's K/V projection is
    the mean of its group's, q_proj_swiftkv and the norm are kept, non-leaders lose theirs."""
    base = make_pair("llama_gqa")[1]
    config = replace(base.config, num_layers=LAYERS, layer_types=())
    state = {name: torch.randn_like(t) for name, t in base.state_dict().items()}
    for layer in range(base.config.num_layers, LAYERS):  # the pair's model is shallower: add layers
        for name in [n for n in state if n.startswith("model.layers.0.")]:
            state[name.replace("layers.0.", f"layers.{layer}.")] = torch.randn_like(state[name])
    single = initial_swiftkv_tensors(state, config, SwiftKVConfig(1, 1))
    grouped = regroup_swiftkv_tensors(single, replace(config, swiftkv=SwiftKVConfig(1, 2)))
    assert set(grouped) == set(swiftkv_tensor_names(replace(config, swiftkv=SwiftKVConfig(1, 2))))
    assert torch.equal(grouped["model.norm_swiftkv.weight"], single["model.norm_swiftkv.weight"])
    assert torch.equal(grouped["model.layers.4.self_attn.q_proj_swiftkv.weight"],
                       single["model.layers.4.self_attn.q_proj_swiftkv.weight"])
    for leader in (1, 3):
        for kind in ("k_proj_swiftkv", "v_proj_swiftkv"):
            mean = (single[f"model.layers.{leader}.self_attn.{kind}.weight"]
                    + single[f"model.layers.{leader + 1}.self_attn.{kind}.weight"]) / 2
            torch.testing.assert_close(grouped[f"model.layers.{leader}.self_attn.{kind}.weight"], mean)


@pytest.mark.parametrize("params_only", [False, True])
def test_written_checkpoint_loads_back_identical(tmp_path, monkeypatch, params_only):
    """Written from a base checkpoint directory, read back through load_model."""
    base_dir = tmp_path / "base"
    base_model = make_pair("qwen2_bias" if not params_only else "smollm2_tied")[1]
    write_checkpoint(base_dir, base_model.config, base_model.state_dict(), torch.float32)
    out = tmp_path / "swift"
    args = ["swiftkv", "init", "--model", str(base_dir), "--num-key-value-layers", "1", "--out", str(out)]
    if params_only:
        args.append("--params-only")
    else:  # the tiny base has no tokenizer to copy
        monkeypatch.setattr("kvforge.models.tokenizer.load_tokenizer", lambda source: _NoTokenizer())
    assert main(args) == 0
    written = load_file(str(out / "model.safetensors"))
    model, _ = load_model(out)
    state = model.state_dict()
    for name, tensor in written.items():
        if name in state:
            assert torch.equal(state[name], tensor), name
    expected = initial_swiftkv_tensors(base_model.state_dict(), base_model.config, SwiftKVConfig(1, 1))
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    if params_only:
        assert set(written) == set(expected)
        assert json.loads((out / "config.json").read_text())["kvforge_base_model"] == str(base_dir)
    # --swiftkv DIR over the base gives the same model
    overlaid, _ = load_model(base_dir, swiftkv=out)
    for name, tensor in overlaid.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_qwen2_checkpoint_states_its_biases_in_the_authors_layout(tmp_path):
    """A Qwen2 SwiftKV model (q/k/v biases, q_proj_swiftkv and the leaders' K/V biased too,
    o_proj without) is written as `qwen2_swiftkv`, and reads back to the same config, the
    same tensors and the same logits."""
    base = make_pair("qwen2_bias")[1]
    model = swiftkv_model(base, 1, 1)
    config = model.config
    hf = hf_config_dict(config)
    assert (hf["model_type"], hf["architectures"]) == ("qwen2_swiftkv", ["Qwen2SwiftKVForCausalLM"])
    assert "attention_bias" not in hf and hf["use_sliding_window"] is False
    assert (hf["swiftkv"], hf["num_key_value_layers"], hf["key_value_group_size"]) == (True, 1, 1)
    assert {"model.layers.1.self_attn.q_proj_swiftkv.bias", "model.layers.1.self_attn.k_proj_swiftkv.bias",
            "model.layers.1.self_attn.v_proj_swiftkv.bias"} <= set(swiftkv_tensor_names(config))
    write_checkpoint(tmp_path / "qwen2", config, model.state_dict(), torch.float32)
    loaded, _ = load_model(tmp_path / "qwen2")
    assert loaded.config.swiftkv == config.swiftkv
    assert (loaded.config.attention_bias, loaded.config.attention_out_bias) == (True, False)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.tensor([[3, 17, 5, 9, 30, 2, 11, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(dense_logits(loaded, ids), dense_logits(model, ids), rtol=0, atol=0)


def test_qwen2_sliding_layers_read_back_layer_for_layer():
    """Qwen2 slides from `max_window_layers` on, only with `use_sliding_window`."""
    base = make_pair("qwen2_bias")[1].config
    config = replace(base, num_layers=4, sliding_window=6, layer_types=("full_attention",) * 2
                     + ("sliding_attention",) * 2, swiftkv=SwiftKVConfig(2, 2))
    hf = hf_config_dict(config)
    assert (hf["use_sliding_window"], hf["max_window_layers"], hf["sliding_window"]) == (True, 2, 6)
    assert config_from_hf_dict(hf) == replace(config, model_type="qwen2_swiftkv")


def test_an_out_projection_bias_alone_is_refused():
    config = replace(make_pair("llama_gqa")[1].config, attention_out_bias=True)
    with pytest.raises(ConfigError, match="attention_bias.*no config.json layout"):
        hf_config_dict(config)


class _NoTokenizer:
    def save_pretrained(self, directory: str) -> None:
        pass


@pytest.mark.parametrize(("first", "group", "parameter"), [(0, 1, "num_key_value_layers"),
                                                           (4, 1, "num_key_value_layers"),
                                                           (1, 3, "key_value_group_size")])
def test_bad_layer_settings_fail_clearly(first, group, parameter):
    config = make_pair("llama_gqa")[1].config  # 3 layers
    with pytest.raises(ConfigError, match=parameter):
        replace(config, swiftkv=SwiftKVConfig(first, group) if first >= 1 else SwiftKVConfig(first))


def test_cli_reports_bad_group_size(tmp_path, capsys):
    code = main(["swiftkv", "init", "--num-key-value-layers", "15", "--group-size", "4",
                 "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err
    assert "key_value_group_size" in err and "30 - 15 = 15" in err


def test_swiftkv_over_a_mismatched_base_is_refused(tmp_path):
    directory, _, _ = published_checkpoint(tmp_path)
    other = tmp_path / "other"
    base = make_pair("smollm2_tied")[1]
    write_checkpoint(other, base.config, base.state_dict(), torch.float32)
    with pytest.raises(ModelLoadError, match="num_layers"):
        load_model(other, swiftkv=directory)
