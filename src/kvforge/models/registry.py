"""Architecture name -> decoder class (SwiftKV configs get the SwiftKV variant)."""

from __future__ import annotations

import torch

from kvforge.config import ModelConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.gemma3 import Gemma3ForCausalLM
from kvforge.models.gemma3_swiftkv import Gemma3SwiftKVForCausalLM
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.llama_swiftkv import LlamaSwiftKVForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
SWIFTKV_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaSwiftKVForCausalLM,
    "gemma3": Gemma3SwiftKVForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    if config.swiftkv is not None:
        return SWIFTKV_CLASSES[config.architecture]  # ModelConfig validated the architecture
    return MODEL_CLASSES[config.architecture]


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> CausalLM:
    """An uninitialised model of the configured architecture, in eval mode."""
    model = model_class(config)(config, dtype=dtype, device=device)
    return model.eval()
