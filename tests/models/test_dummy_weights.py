"""`--load-format dummy`: a config's shapes with weights drawn from a seed. The draws are
deterministic, per name (so transformers gets the same weights and a reader of a few tensors
the same values), scaled so activations stay finite in bf16 at an 8B model's width; every
way of naming a model that has no config is refused, naming the option."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError
from kvforge.models.dense import dense_logits
from kvforge.models.dummy_weights import SCALES, DummyState, fill_dummy_weights
from kvforge.models.loader import load_model, load_model_config, resolve_model_source
from kvforge.models.model_shapes import SHAPES_DIR, shape_names
from kvforge.models.registry import build_model
from kvforge.tools.bench.hf_peer import load_hf_peer

TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": True}
TINY_GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
               "max_position_embeddings": 512, "sliding_window": 8, "query_pre_attn_scalar": 32,
               "layer_types": ["sliding_attention", "full_attention"]}


def write_config(tmp_path, data: dict) -> str:
    path = tmp_path / f"{data['model_type']}.json"
    path.write_text(json.dumps(data))
    return str(path)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_the_same_seed_draws_the_same_weights_and_another_seed_other_ones():
    first = parameters(load_model("llama-tiny", load_format="dummy")[0])
    again = parameters(load_model("llama-tiny", load_format="dummy")[0])
    other = parameters(load_model("llama-tiny", load_format="dummy", seed=1)[0])
    assert first.keys() == again.keys() == other.keys()
    # each tensor its own draw, not one stream shared by every tensor of a shape
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], first["model.layers.1.mlp.up_proj.weight"])
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        if tensor.std() > 0:  # norms (1) and biases (0) are constants, the same for every seed
            assert not torch.equal(tensor, other[name]), name


def test_a_tensor_read_alone_is_the_one_the_model_holds():
    """swiftkv init reads a few tensors of the lazy state dict: they are the model's."""
    model, source = load_model("llama-tiny", load_format="dummy")
    state = DummyState(model.config, source.seed)
    assert set(state) == set(dict(model.named_parameters()))
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(state[name], model.get_parameter(name))


def test_scales_norms_and_biases_follow_the_measured_checkpoints():
    config = replace(load_model_config(resolve_model_source("llama-tiny", "dummy")), attention_bias=True)
    model = build_model(config)
    fill_dummy_weights(model, config)
    gains = SCALES["llama"].gains
    down = model.get_parameter("model.layers.0.mlp.down_proj.weight")
    assert down.std().item() == pytest.approx(gains["down_proj"] / config.intermediate_size ** 0.5, rel=0.05)
    assert model.get_parameter("model.embed_tokens.weight").std().item() == pytest.approx(
        SCALES["llama"].embedding_std, rel=0.05)
    assert torch.all(model.get_parameter("model.layers.1.input_layernorm.weight") == 1)
    assert torch.all(model.get_parameter("model.layers.1.self_attn.q_proj.bias") == 0)


def test_gemma_norms_are_stored_as_zero_so_they_scale_by_one(tmp_path):
    model, _ = load_model(write_config(tmp_path, TINY_GEMMA3), load_format="dummy")
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms and all(torch.all(p == 0) for p in norms)


@pytest.mark.parametrize("config", ["llama-tiny", TINY_QWEN2, TINY_GEMMA3], ids=["llama", "qwen2", "gemma3"])
def test_the_transformers_peer_gets_the_same_weights_and_logits(tmp_path, config):
    model_arg = config if isinstance(config, str) else write_config(tmp_path, config)
    ours, source = load_model(model_arg, load_format="dummy")
    peer = load_hf_peer(source, torch.float32)
    theirs = dict(peer.named_parameters())
    for name, tensor in ours.named_parameters():
        assert torch.equal(tensor, theirs[name]), name
    ids = torch.randint(0, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = peer(ids).logits
        got = dense_logits(ours, ids)
    assert expected.abs().max() > 1  # not a degenerate model
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("shape, layers, vocab", [("llama-3.1-8b", 1, 2048), ("llama-tiny", 32, None)],
                         ids=["8b-width", "8b-depth"])
def test_activations_stay_finite_in_bf16_at_an_8b_size(shape, layers, vocab):
    """Llama-3.1-8B's width (hidden 4096, MLP 14336, 32/8 heads) with one layer and a smaller
    vocabulary (the full model in fp32 would not fit this machine), and its depth (32 layers,
    where the residual stream grows) at a tiny width: finite logits, not degenerate."""
    full = load_model_config(resolve_model_source(shape, "dummy"))
    config = replace(full, num_layers=layers, layer_types=(), vocab_size=vocab or full.vocab_size)
    model = build_model(config, dtype=torch.bfloat16)
    fill_dummy_weights(model, config)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = dense_logits(model, ids)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()  # a bf16 model's logits are float32
    assert logits.float().std() > 0.1 and len(set(logits[0].argmax(-1).tolist())) > 1


def test_every_shipped_shape_reads_and_names_its_source():
    assert {"llama-3.1-8b", "llama-2-7b", "llama-3-8b-1048k", "qwen2.5-7b", "llama-tiny"} <= set(shape_names())
    for name in shape_names():
        source = resolve_model_source(name, "dummy")
        assert source.kind == "dummy" and source.path == SHAPES_DIR / f"{name}.json"
        assert source.weights == "dummy (random, seed 0)"
        load_model_config(source)
    qwen = load_model_config(resolve_model_source("qwen2.5-7b", "dummy"))
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.sliding_window is None


def test_a_directory_and_a_config_file_name_the_same_model(tmp_path):
    (tmp_path / "config.json").write_text((SHAPES_DIR / "llama-tiny.json").read_text())
    by_dir = load_model_config(resolve_model_source(str(tmp_path), "dummy"))
    by_file = load_model_config(resolve_model_source(str(tmp_path / "config.json"), "dummy"))
    assert by_dir == by_file == load_model_config(resolve_model_source("llama-tiny", "dummy"))


@pytest.mark.parametrize("model, load_format, parameter", [
    ("llama-tiny", "safetensors", "load_format"),  # not a load format
    ("llama-9b", "dummy", "model"),  # no such shape
    ("/nonexistent/config.json", "dummy", "model"),  # a config path that is missing
])
def test_what_has_no_config_is_refused_naming_the_option(model, load_format, parameter):
    with pytest.raises(ConfigError) as info:
        resolve_model_source(model, load_format)
    assert info.value.parameter == parameter
    if parameter == "model":
        assert "llama-3.1-8b" in str(info.value)  # the shapes a user can name instead


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="without config.json"):
        resolve_model_source(str(tmp_path), "dummy")


def test_llm_on_a_dummy_model_takes_token_ids_and_refuses_text():
    llm = LLM("llama-tiny", load_format="dummy", dtype="float32", kv_budget="16MiB")
    assert llm.tokenizer is None and not llm.is_chat_model
    [output] = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(output.token_ids) == 4 and output.text == ""
    [refused] = llm.generate(["some text"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert refused.finish_reason == "error" and "token ids" in refused.error and "dummy" in refused.error
