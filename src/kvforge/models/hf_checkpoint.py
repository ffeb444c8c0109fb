"""Reading Hugging Face checkpoint directories (config.json + safetensors).

The state dict keeps Hugging Face names of the text decoder (`model.embed_tokens.weight`,
`model.layers.N...`, `lm_head.weight`). Multimodal Gemma3 checkpoints nest the decoder
under a language-model prefix and carry a vision tower; the prefix is stripped and the
vision tensors are dropped so both kinds of checkpoint produce the same names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvforge.config import ModelConfig
from kvforge.errors import ModelLoadError
from kvforge.models.hf_config import config_from_hf_dict

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# (prefix in the checkpoint, replacement): transformers 5 and 4.x layouts of Gemma3 multimodal.
_PREFIX_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# Tensors of other modalities, not used by a text-only decoder.
_DROPPED_PREFIXES = (
    "vision_tower.", "model.vision_tower.",
    "multi_modal_projector.", "model.multi_modal_projector.",
)


def read_hf_config_dict(directory: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ModelLoadError(f"no {CONFIG_FILE} in {Path(directory)}")
    return _read_json_object(path)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def read_hf_config(directory: str | Path) -> ModelConfig:
    """ModelConfig of a Hugging Face checkpoint directory (ConfigError on unsupported values,
    ModelLoadError naming the field a partial config.json lacks)."""
    return read_hf_config_file(Path(directory) / CONFIG_FILE)


def read_hf_config_file(path: str | Path) -> ModelConfig:
    """ModelConfig of a config.json file, wherever it lies (errors as read_hf_config's)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no {CONFIG_FILE} in {path.parent}" if path.name == CONFIG_FILE
                             else f"no such file: {path}")
    try:
        return config_from_hf_dict(_read_json_object(path))
    except KeyError as missing:
        raise ModelLoadError(f"{path} lacks the field {missing.args[0]!r}") from None


def safetensors_files(directory: str | Path) -> list[Path]:
    """The safetensors files holding the weights: the shards of the index, or the single file."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read the weight_map of {index}: {exc}") from exc
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in shards if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shards: {', '.join(missing)}")
        return shards
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")


def normalize_hf_name(name: str) -> str | None:
    """Text-decoder name of a checkpoint tensor, or None for a tensor to drop."""
    if name.startswith(_DROPPED_PREFIXES):
        return None
    for prefix, replacement in _PREFIX_RENAMES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def read_hf_state_dict(directory: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All decoder tensors of a checkpoint directory, HF-named, converted to `dtype`."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(directory):
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                name = normalize_hf_name(key)
                if name is None:
                    continue
                if name in state:
                    raise ModelLoadError(f"{shard}: tensor {key!r} duplicates {name!r}")
                state[name] = handle.get_tensor(key).to(dtype).contiguous()
    return state
