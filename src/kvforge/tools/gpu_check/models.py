"""The models a check runs: the same weights once on the CPU (the reference) and once on
the device under test.

- tiny: a random 4-layer Llama (GQA 4/2, head_dim 16, tied embeddings) built in-process
  from a fixed seed, and a SwiftKV model over it (l = 2, one AcrossKV group of 2 later
  layers) initialised as `kvforge swiftkv init` does, then perturbed so that a wiring
  mistake cannot hide behind the initialisation;
- real: the named model (smollm2-135m) and the committed SwiftKV model laid over it,
  loaded from local files only.
Both sides are built from one state dict, so any difference comes from the device.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.loader import load_model
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors, model_state_for_swiftkv

CPU = torch.device("cpu")
# Relative size of the weight noise that stands in for another device's rounding: a float32
# dot product of K = 576 terms summed in another order differs by about sqrt(K) x 2^-24
# (1.4e-6) relative, and cuBLAS sums in another order than the CPU.
ROUNDING_NOISE = 1e-6

TINY_HF_CONFIG = {
    "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
TINY_SWIFTKV = SwiftKVConfig(num_key_value_layers=2, key_value_group_size=2)


@dataclass
class ModelPair:
    """The reference (CPU, float32) and the device model, with the same weights."""

    reference: CausalLM
    device: CausalLM
    description: str
    _perturbed: CausalLM | None = field(default=None, repr=False)
    _perturbed_seed: int | None = field(default=None, repr=False)

    def perturbed_reference(self, seed: int = 1) -> CausalLM:
        """The reference with every weight scaled by 1 + ROUNDING_NOISE x N(0, 1) from the
        generator seeded `seed`: how far rounding alone moves a discontinuous method
        (compare.RoundingFloor). One copy is kept and re-drawn in place for another seed (a
        real-size copy is 0.5 GB; rows ask for seed 1 first, later seeds rarely)."""
        if self._perturbed is None:
            self._perturbed = copy.deepcopy(self.reference)
        if self._perturbed_seed != seed:
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for param, original in zip(self._perturbed.parameters(), self.reference.parameters()):
                    param.copy_(original).mul_(1 + ROUNDING_NOISE * torch.randn(param.shape, generator=generator))
            self._perturbed_seed = seed
        return self._perturbed


def _tiny_base_state(seed: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = config_from_hf_dict(TINY_HF_CONFIG)
    model = build_model(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # Norm weights near 1 and small projections keep activations in a normal range.
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return config, {name: p.detach().clone() for name, p in model.named_parameters()}


def _tiny_state(kind: str, seed: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config, state = _tiny_base_state(seed)
    if kind == "base":
        return config, state
    config = replace(config, swiftkv=TINY_SWIFTKV)
    state.update(initial_swiftkv_tensors(state, config, TINY_SWIFTKV))
    generator = torch.Generator().manual_seed(seed + 1)
    for name in [n for n in state if "swiftkv" in n]:
        state[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=generator)
    return config, model_state_for_swiftkv(state, config)


def _built(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> CausalLM:
    model = build_model(config, dtype=torch.float32, device=device)
    model.load_hf_state_dict(state)
    return model.eval()


def tiny_pair(kind: str, device: torch.device, seed: int = 0) -> ModelPair:
    config, state = _tiny_state(kind, seed)
    return ModelPair(_built(config, state, CPU), _built(config, state, device),
                     f"tiny random llama ({config.num_layers} layers"
                     + (f", SwiftKV l={TINY_SWIFTKV.num_key_value_layers} g={TINY_SWIFTKV.key_value_group_size})"
                        if kind == "swiftkv" else ")"))


def real_pair(kind: str, device: torch.device, model: str, swiftkv: str | Path) -> ModelPair:
    overlay = swiftkv if kind == "swiftkv" else None
    reference, source = load_model(model, dtype=torch.float32, device=CPU, swiftkv=overlay)
    on_device, _ = load_model(model, dtype=torch.float32, device=device, swiftkv=overlay)
    return ModelPair(reference, on_device, f"{model} ({source.path})" + (f" + SwiftKV {overlay}" if overlay else ""))
