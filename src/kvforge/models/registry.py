"""Architecture name -> decoder class."""

from __future__ import annotations

import torch

from kvforge.config import ModelConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.gemma3 import Gemma3ForCausalLM
from kvforge.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> CausalLM:
    """An uninitialised model of the configured architecture, in eval mode."""
    model = MODEL_CLASSES[config.architecture](config, dtype=dtype, device=device)
    return model.eval()
