"""A plain Llama Hugging Face directory of a kvforge base model, for base-vs-SwiftKV runs.

`kvforge swiftkv export` writes the SwiftKV checkpoint; comparing it with the base model in
vLLM needs the base in a form vLLM loads, with the very same weights. kvforge's named models
are GGUF files that kvforge dequantises; writing that state dict back as float32
safetensors (plus config.json and the tokenizer) gives vLLM exactly kvforge's base weights.

Needs only kvforge (and its own dependencies), not vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch


def write_base_checkpoint(model: str, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` (a kvforge named model, .gguf file or HF directory) to `out` as a
    self-contained `LlamaForCausalLM` directory; a SwiftKV checkpoint is refused."""
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model_config, load_state_dict, resolve_model_source
    from kvforge.models.swiftkv_checkpoint import write_checkpoint
    from kvforge.models.tokenizer import load_tokenizer

    source = resolve_model_source(model)
    config = load_model_config(source)
    if config.swiftkv is not None:
        raise ConfigError("model", model, "must be a base model, not a SwiftKV checkpoint")
    state = load_state_dict(source, config, dtype=dtype)
    out = write_checkpoint(out, replace(config, swiftkv=None), state, dtype)
    load_tokenizer(source).save_pretrained(str(out))
    return out
