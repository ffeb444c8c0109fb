"""Adding a model family takes one module (its layer, its CausalLM and its registry entry),
nothing in kvforge's config, loaders or engine: a tiny family defined here, a Llama variant
whose layer runs attention and MLP in parallel from one norm (as GPT-J does), is read from
a config.json by its model_type, written and read back as a checkpoint directory and as a
GGUF file, and generates through the engine by name the greedy tokens of a plain dense
forward of the same weights written below."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from server_helpers import char_tokenizer
from torch import nn

from kvforge.config import ModelConfig, RopeConfig, SwiftKVConfig
from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError
from kvforge.models.causal_lm import CausalLM
from kvforge.models.family import (
    GGUF_COMMON_BLOCK_NAMES,
    GGUFArchitecture,
    HFLayout,
    ModelFamily,
    family_named,
    register_family,
)
from kvforge.models.gguf_checkpoint import read_gguf_config, read_gguf_state_dict
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.layers import CachedAttention, GatedMLP, RMSNorm
from kvforge.models.loader import load_model
from kvforge.models.registry import build_model, num_parameters
from kvforge.models.swiftkv_checkpoint import hf_config_dict, write_checkpoint


# -- the family ----------------------------------------------------------------------------
class ParallelDecoderLayer(nn.Module):
    """h + attn(norm(h)) + mlp(norm(h)): one norm, attention and MLP side by side."""

    def __init__(self, config: ModelConfig, cache_layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = CachedAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                                         c.attention_out_bias, cache_layer, dtype=dtype, device=device)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, dtype, device)

    def forward(self, hidden, cache, meta, rope):
        x = self.input_layernorm(hidden)
        return hidden + self.self_attn(x, cache, meta, rope) + self.mlp(x)


class ParallelForCausalLM(CausalLM):
    def make_layer(self, layer, dtype, device):
        return ParallelDecoderLayer(self.config, layer, dtype, device)

    def make_norm(self, dim, dtype, device):
        return RMSNorm(dim, self.config.rms_norm_eps, dtype, device)


def _hf_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    return dict(rope=RopeConfig.from_hf(config.get("rope_theta", 10000.0), config.get("rope_scaling")),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))


FAMILY = register_family(ModelFamily(
    name="parallel_llama",
    model_types=("parallel_llama",),
    hf_fields=_hf_fields,
    causal_lm=ParallelForCausalLM,
    swiftkv_causal_lm=None,
    hf_layouts=(HFLayout("parallel_llama", "ParallelLlamaForCausalLM", "ParallelLlamaSwiftKVForCausalLM"),),
    hf_layout_of=lambda config: "parallel_llama",
    hf_fields_of=lambda config, layout: {},
    gguf_architectures=(GGUFArchitecture("parallel_llama", "parallel_llama", GGUF_COMMON_BLOCK_NAMES,
                                         lambda meta, config: None),),
))

HF = {"model_type": "parallel_llama", "vocab_size": 128, "hidden_size": 48, "intermediate_size": 80,
      "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 256, "rope_theta": 500.0}


def random_model(tied: bool = False) -> CausalLM:
    model = build_model(config_from_hf_dict({**HF, "tie_word_embeddings": tied}))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


# -- a plain dense forward of the same weights --------------------------------------------
def dense_logits(state: dict[str, torch.Tensor], config: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of every position, from the HF-named weights alone."""
    n, heads, kv_heads, dim = len(tokens), config.num_heads, config.num_kv_heads, config.head_dim

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    def rotate(x):  # [n, heads, dim], rotate-half convention
        inv_freq = config.rope.theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin

    h = state["model.embed_tokens.weight"][tokens]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(config.num_layers):
        w = {k.removeprefix(f"model.layers.{layer}."): v for k, v in state.items()
             if k.startswith(f"model.layers.{layer}.")}
        x = norm(h, w["input_layernorm.weight"])
        q = rotate((x @ w["self_attn.q_proj.weight"].T).view(n, heads, dim))
        k = rotate((x @ w["self_attn.k_proj.weight"].T).view(n, kv_heads, dim))
        v = (x @ w["self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
        group = heads // kv_heads  # query head i reads KV head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * dim) @ w["self_attn.o_proj.weight"].T
        mlp = (F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        h = h + attn + mlp
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return norm(h, state["model.norm.weight"]) @ head.T


def dense_greedy(state: dict[str, torch.Tensor], config: ModelConfig, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(dense_logits(state, config, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def save(model: CausalLM, directory: Path) -> Path:
    write_checkpoint(directory, model.config, dict(model.state_dict()), torch.float32)
    char_tokenizer().save_pretrained(str(directory))
    return directory


# -- tests ---------------------------------------------------------------------------------
def test_the_family_is_read_from_its_model_type():
    config = config_from_hf_dict(HF)
    assert config.architecture == "parallel_llama" and family_named("parallel_llama") is FAMILY
    assert (config.num_kv_heads, config.head_dim, config.rope.theta) == (2, 8, 500.0)
    assert type(build_model(config)) is ParallelForCausalLM
    # one norm per layer: the count comes from the family's own modules
    h, i, kv = 48, 80, 2 * 8
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + h  # q, o; k, v; gated MLP; one norm
    assert num_parameters(config) == 2 * 128 * h + 3 * per_layer + h


@pytest.mark.parametrize("tied", [False, True])
def test_it_generates_by_name_the_dense_forwards_greedy_tokens(tmp_path, tied):
    model = random_model(tied)
    directory = save(model, tmp_path / "ckpt")
    prompts = [[5, 9, 14, 3, 77, 41, 8], list(range(20, 43)), [100]]
    llm = LLM(str(directory), cache="full:block_size=4", kv_budget="4MiB", max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams.greedy_params(max_tokens=8, ignore_eos=True), use_tqdm=False)
    state = dict(model.state_dict())
    assert [out.token_ids for out in outs] == [dense_greedy(state, model.config, p, 8) for p in prompts]


def test_a_checkpoint_reads_back_tensor_for_tensor(tmp_path):
    model = random_model()
    assert config_from_hf_dict(hf_config_dict(model.config)) == model.config
    loaded, _ = load_model(save(model, tmp_path / "ckpt"))
    assert type(loaded) is ParallelForCausalLM and loaded.config == model.config
    assert all(torch.equal(p, loaded.state_dict()[name]) for name, p in model.state_dict().items())


def test_a_gguf_file_of_the_family_reads_as_its_checkpoint(tmp_path):
    model = random_model()
    c, state = model.config, dict(model.state_dict())
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "parallel_llama")
    for method, value in dict(block_count=c.num_layers, context_length=c.max_position_embeddings,
                              embedding_length=c.hidden_size, feed_forward_length=c.intermediate_size,
                              head_count=c.num_heads, head_count_kv=c.num_kv_heads, rope_freq_base=c.rope.theta,
                              layer_norm_rms_eps=c.rms_norm_eps).items():
        getattr(writer, f"add_{method}")(value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for gguf_part, hf_part in GGUF_COMMON_BLOCK_NAMES.items():
        for layer in range(c.num_layers):
            names[f"model.layers.{layer}.{hf_part}.weight"] = f"blk.{layer}.{gguf_part}.weight"
    for hf_name, gguf_name in names.items():
        writer.add_tensor(gguf_name, state[hf_name].numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = read_gguf_config(tmp_path / "tiny.gguf")
    assert config == replace(c, bos_token_id=None, eos_token_ids=())
    read = read_gguf_state_dict(tmp_path / "tiny.gguf", config)
    assert read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state)


def test_a_family_cannot_take_another_familys_names():
    with pytest.raises(ConfigError, match="model family.*llama"):
        register_family(replace(FAMILY, name="other", model_types=("llama",), gguf_architectures=()))
    with pytest.raises(ConfigError, match="model family.*parallel_llama"):
        register_family(replace(FAMILY, name="other", model_types=("other",)))
    assert register_family(FAMILY) is FAMILY  # the same entry again: nothing changes


def test_unknown_families_and_model_types_are_refused_by_name():
    with pytest.raises(ConfigError, match="architecture.*'nope'.*known model families are.*parallel_llama"):
        build_model(replace(config_from_hf_dict(HF), architecture="nope"))
    with pytest.raises(ConfigError, match="model_type.*supported model types are.*parallel_llama"):
        config_from_hf_dict({**HF, "model_type": "parallel_llama_swiftkv"})
    with pytest.raises(ConfigError, match="swiftkv.*no SwiftKV variant"):
        hf_config_dict(replace(config_from_hf_dict(HF), swiftkv=SwiftKVConfig(2)))
