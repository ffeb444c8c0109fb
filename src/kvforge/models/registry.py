"""ModelConfig -> its family's decoder class (SwiftKV configs get the SwiftKV variant), and
what follows from the class alone: the model, its parameter count."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvforge.config import ModelConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.family import family_of


def model_class(config: ModelConfig) -> type[CausalLM]:
    """ConfigError when `config.architecture` names no registered family."""
    return family_of(config).model_class(config.swiftkv is not None)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> CausalLM:
    """An uninitialised model of the configured architecture, in eval mode."""
    model = model_class(config)(config, dtype=dtype, device=device)
    return model.eval()


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the base model (SwiftKV fields ignored; a tied embedding counted once),
    counted on the family's own modules built on the meta device, so no formula per family
    can drift from the layers."""
    model = model_class(replace(config, swiftkv=None))(replace(config, swiftkv=None), device="meta")
    return sum(p.numel() for p in model.parameters())
