"""SwiftKV Qwen2 against references written with transformers' own classes: with l = L it
is `Qwen2ForCausalLM` on the same weights; with l < L it equals a transformers Qwen2 whose
later layers take SwiftKV's queries and their group leader's K/V of norm_swiftkv(h_l)."""

from __future__ import annotations

import torch
import transformers
from conftest import TINY, make_pair, make_runner
from swiftkv_helpers import swiftkv_model
from torch import nn

from kvforge.config import ModelConfig
from kvforge.engine.runner import StepItem
from kvforge.models.registry import build_model
from kvforge.swiftkv.dense import dense_logits

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


def transformers_swiftkv(hf: transformers.Qwen2ForCausalLM, model) -> transformers.Qwen2ForCausalLM:
    """`hf` rewired as SwiftKV with `model`'s SwiftKV tensors, in transformers' modules."""
    swift, config = model.config.swiftkv, model.config
    state = model.state_dict()
    captured: dict[str, torch.Tensor] = {}
    first = swift.num_key_value_layers

    def capture(module, args, kwargs):
        captured["h_l"] = args[0] if args else kwargs["hidden_states"]

    hf.model.layers[first].register_forward_pre_hook(capture, with_kwargs=True)
    norm = transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight.data.copy_(state["model.norm_swiftkv.weight"])
    for index in range(first, config.num_layers):
        attn, leader = hf.model.layers[index].self_attn, first + (index - first) // swift.key_value_group_size * \
            swift.key_value_group_size
        prefix = f"model.layers.{index}.self_attn."
        attn.q_proj.weight.data.copy_(state[prefix + "q_proj_swiftkv.weight"])
        attn.q_proj.bias.data.copy_(state[prefix + "q_proj_swiftkv.bias"])
        for kind in ("k_proj", "v_proj"):
            source = f"model.layers.{leader}.self_attn.{kind}_swiftkv."
            projection = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim)
            projection.weight.data.copy_(state[source + "weight"])
            projection.bias.data.copy_(state[source + "bias"])
            setattr(attn, kind, _LeaderProjection(captured, norm, projection))
    return hf


def qwen2_pair(layers: int, seed: int = 3) -> tuple[transformers.Qwen2ForCausalLM, object]:
    torch.manual_seed(seed)
    hf_config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": layers, "num_key_value_heads": 2})
    hf_config._attn_implementation = "eager"
    hf = transformers.Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    base = build_model(ModelConfig.from_hf_dict(hf_config.to_dict()))
    base.load_hf_state_dict(hf.state_dict())
    return hf, base


def test_qwen2_swiftkv_equals_a_transformers_reference():
    """l = 1, AcrossKV groups of 2 over 3 layers: the leader's biased K/V serve both later layers."""
    hf, base = qwen2_pair(3)
    model = swiftkv_model(base, 1, 2, seed=1)
    reference = transformers_swiftkv(hf, model)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        expected = reference(ids).logits[0]
        assert (expected - dense_logits(base, ids)[0]).abs().max() > 1e-2  # the rewiring changed the model
        torch.testing.assert_close(dense_logits(model, ids)[0], expected, atol=1e-5, rtol=0)
    for chunk in (37, 6):
        torch.testing.assert_close(engine_logits(model, TOKENS, chunk), expected, atol=1e-4, rtol=0)

