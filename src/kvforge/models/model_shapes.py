"""What `--model` names under `--load-format dummy`: a config to build, never weights to read.

Accepted, in this order: a named shape (a config.json shipped in `models/shapes/`, below), a
config.json file, a directory holding one, a .gguf file or a named model (their metadata
only). Nothing is downloaded: a Hub id is refused, as is a path that does not exist.

The shipped shapes are the config.json fields of the published checkpoints (their model
cards' config.json on the Hugging Face Hub), with no weights:
- `llama-3.1-8b`: meta-llama/Llama-3.1-8B (llama3 RoPE scaling, 128K positions);
- `llama-2-7b`: meta-llama/Llama-2-7b-hf (multi-head attention: 32 KV heads), KIVI's model;
- `llama-3-8b-1048k`: gradientai/Llama-3-8B-Instruct-Gradient-1048k, ShadowKV's model
  (rope_theta 3,580,165,449, 1,048,576 positions);
- `qwen2.5-7b`: Qwen/Qwen2.5-7B (q/k/v biases, GQA 28/4, no sliding window in use);
- `llama-tiny`: kvforge's own 4-layer Llama of hidden size 256, for smoke runs and tests.
"""

from __future__ import annotations

from pathlib import Path

from kvforge.errors import ConfigError
from kvforge.models.hf_checkpoint import CONFIG_FILE

SHAPES_DIR = Path(__file__).parent / "shapes"


def shape_names() -> list[str]:
    """The named shapes: the stems of the shipped config files."""
    return sorted(path.stem for path in SHAPES_DIR.glob("*.json"))


def dummy_config_path(model: str) -> Path:
    """The file whose config a dummy `model` is built from: a config.json (shipped, given, or
    inside a given directory) or a .gguf file. ConfigError naming `model` when there is none."""
    from kvforge.models.named_models import NAMED_MODELS, locate_named_model

    accepted = (f"with --load-format dummy, --model names a shape ({', '.join(shape_names())}), "
                f"a config.json file, a directory holding one, a .gguf file or a named model "
                f"({', '.join(sorted(NAMED_MODELS))})")
    if model in shape_names():
        return SHAPES_DIR / f"{model}.json"
    if model in NAMED_MODELS:
        return locate_named_model(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise ConfigError("model", model, f"is a directory without {CONFIG_FILE}; {accepted}")
        return path / CONFIG_FILE
    if path.is_file():
        return path
    raise ConfigError("model", model, f"no such shape, file or directory; {accepted}")
