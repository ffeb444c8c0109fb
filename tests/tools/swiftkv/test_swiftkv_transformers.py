"""SwiftKV Qwen2 and Gemma3 against references written with transformers' own classes: with
l = L Qwen2 is `Qwen2ForCausalLM` on the same weights; with l < L each equals a transformers
model whose later layers take SwiftKV's queries and their group leader's K/V of
norm_swiftkv(h_l)."""

from __future__ import annotations

import torch
import transformers
from conftest import make_pair, make_runner
from swiftkv_helpers import qwen2_pair, swiftkv_model
from torch import nn

from kvforge.engine.runner import StepItem
from kvforge.models.dense import dense_logits

TOKENS = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(6)).tolist()


def engine_logits(model, tokens: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, prefilled in chunks that ask logits for each of their tokens."""
    runner = make_runner(model)
    rows = [runner.step([StepItem(0, tokens[s:s + chunk], len(tokens[s:s + chunk]))])
            for s in range(0, len(tokens), chunk)]
    return torch.cat(rows)


def test_qwen2_with_every_layer_keeping_its_kv_is_transformers_qwen2():
    hf, base = make_pair("qwen2_bias")
    assert isinstance(hf, transformers.Qwen2ForCausalLM)
    model = swiftkv_model(base, base.config.num_layers, 1)  # perturbed SwiftKV tensors: all unused
    with torch.no_grad():
        expected = hf(torch.tensor([TOKENS])).logits[0]
        torch.testing.assert_close(dense_logits(model, torch.tensor([TOKENS]))[0], expected, atol=1e-5, rtol=0)
    for chunk in (37, 5):
        torch.testing.assert_close(engine_logits(model, TOKENS, chunk), expected, atol=1e-5, rtol=0)


class _LeaderProjection(nn.Module):
    """Stands in for a later layer's k_proj / v_proj inside the transformers model: ignores
    its own input and projects norm_swiftkv(h_l), h_l captured by a hook on layer l."""

    def __init__(self, captured: dict[str, torch.Tensor], norm: nn.Module, projection: nn.Linear) -> None:
        super().__init__()
        self.captured, self.norm, self.projection = captured, norm, projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.norm(self.captured["h_l"]))


def transformers_swiftkv(hf: transformers.PreTrainedModel, model, norm_class: type[nn.Module]) -> nn.Module:
    """`hf` rewired as SwiftKV with `model`'s SwiftKV tensors, in transformers' modules:
    `norm_class` (the family's RMSNorm) as norm_swiftkv. transformers applies a layer's own
    k_norm to its keys, which is the leader's only with one layer per group."""
    swift, config = model.config.swiftkv, model.config
    state = model.state_dict()
    captured: dict[str, torch.Tensor] = {}
    first = swift.num_key_value_layers

    def capture(module, args, kwargs):
        captured["h_l"] = args[0] if args else kwargs["hidden_states"]

    hf.model.layers[first].register_forward_pre_hook(capture, with_kwargs=True)
    norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight.data.copy_(state["model.norm_swiftkv.weight"])
    for index in range(first, config.num_layers):
        attn, leader = hf.model.layers[index].self_attn, first + (index - first) // swift.key_value_group_size * \
            swift.key_value_group_size
        prefix = f"model.layers.{index}.self_attn."
        attn.q_proj.weight.data.copy_(state[prefix + "q_proj_swiftkv.weight"])
        if config.attention_bias:
            attn.q_proj.bias.data.copy_(state[prefix + "q_proj_swiftkv.bias"])
        for kind in ("k_proj", "v_proj"):
            source = f"model.layers.{leader}.self_attn.{kind}_swiftkv."
            projection = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim,
                                   bias=config.attention_bias)
            projection.weight.data.copy_(state[source + "weight"])
            if config.attention_bias:
                projection.bias.data.copy_(state[source + "bias"])
            setattr(attn, kind, _LeaderProjection(captured, norm, projection))
    return hf


def test_qwen2_swiftkv_equals_a_transformers_reference():
    """l = 1, AcrossKV groups of 2 over 3 layers: the leader's biased K/V serve both later layers."""
    hf, base = qwen2_pair(3)
    model = swiftkv_model(base, 1, 2, seed=1)
    reference = transformers_swiftkv(hf, model, transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        expected = reference(ids).logits[0]
        assert (expected - dense_logits(base, ids)[0]).abs().max() > 1e-2  # the rewiring changed the model
        torch.testing.assert_close(dense_logits(model, ids)[0], expected, atol=1e-5, rtol=0)
    for chunk in (37, 6):
        torch.testing.assert_close(engine_logits(model, TOKENS, chunk), expected, atol=1e-4, rtol=0)



def test_gemma3_swiftkv_equals_a_transformers_reference():
    """l = 1 over global, sliding, global later layers: Gemma's (1 + w) norm_swiftkv, each
    layer's QK-norm, window and local or global RoPE, as transformers' Gemma3 computes them."""
    hf, base = make_pair("gemma3_hybrid")
    model = swiftkv_model(base, 1, 1, seed=2)
    reference = transformers_swiftkv(hf, model, transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm)
    ids = torch.tensor([TOKENS])  # longer than the window of 10
    with torch.no_grad():
        expected = reference(ids).logits[0]
        assert (expected - dense_logits(base, ids)[0]).abs().max() > 1e-2
        torch.testing.assert_close(dense_logits(model, ids)[0], expected, atol=1e-5, rtol=0)
    for chunk in (37, 6):
        torch.testing.assert_close(engine_logits(model, TOKENS, chunk), expected, atol=1e-4, rtol=0)
