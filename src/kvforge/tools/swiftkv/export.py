"""`kvforge swiftkv export`: a self-contained SwiftKV checkpoint in the authors' layout.

A params-only checkpoint (what distillation writes and `models/` commits) holds only the
SwiftKV tensors and names its base model. Serving stacks that know the authors' format
(their vLLM plugin, `kvforge.integrations.vllm`) need one directory with everything:

- config.json with `model_type: llama_swiftkv` and no kvforge-only keys;
- every base weight, the later layers' original q/k/v_proj included (the authors keep them
  as the distillation teacher; SwiftKV inference ignores them);
- the SwiftKV tensors, and the tokenizer files.

Invariant: loading the exported directory gives the same model, tensor for tensor, as
loading the params-only checkpoint over its base at the export dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.errors import ConfigError, ModelLoadError
from kvforge.models.hf_checkpoint import CONFIG_FILE
from kvforge.models.loader import load_model_config, load_state_dict, resolve_model_source
from kvforge.models.swiftkv_checkpoint import (
    base_model_of,
    overlay_config,
    read_overlay_tensors,
    swiftkv_tensor_names,
    write_checkpoint,
)
from kvforge.models.tokenizer import load_tokenizer


@dataclass(frozen=True)
class ExportResult:
    out: Path
    base_model: str
    num_key_value_layers: int
    key_value_group_size: int
    num_tensors: int
    bytes_written: int


def check_export_target(swiftkv_dir: Path, out: Path) -> None:
    """`out` must be a new or empty directory other than the source (nothing is overwritten)."""
    if out.resolve() == swiftkv_dir.resolve():
        raise ConfigError("out", str(out), "must differ from the --swiftkv directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("out", str(out), "must be a new or empty directory (export never overwrites)")


def export_full_checkpoint(swiftkv_dir: str | Path, out: str | Path, base_model: str | None = None,
                           dtype: torch.dtype = torch.float32, tokenizer: bool = True) -> ExportResult:
    """Write `swiftkv_dir` laid over its base model as one self-contained directory `out`.

    `base_model` defaults to the base a params-only checkpoint names; a full checkpoint is
    its own base (re-exporting it drops kvforge-only keys and changes the dtype)."""
    swiftkv_dir, out = Path(swiftkv_dir).expanduser(), Path(out).expanduser()
    if not (swiftkv_dir / CONFIG_FILE).is_file():
        raise ModelLoadError(f"SwiftKV checkpoint {swiftkv_dir} has no {CONFIG_FILE}")
    check_export_target(swiftkv_dir, out)
    base = base_model or base_model_of(swiftkv_dir) or str(swiftkv_dir)
    source = resolve_model_source(base)
    base_config = load_model_config(source)
    config = overlay_config(base_config, swiftkv_dir)  # shapes checked before any weight is read
    state = load_state_dict(source, base_config, dtype=dtype)
    state.update(read_overlay_tensors(swiftkv_dir, dtype))
    missing = [name for name in swiftkv_tensor_names(config) if name not in state]
    if missing:
        raise ModelLoadError(f"SwiftKV checkpoint {swiftkv_dir} lacks {len(missing)} SwiftKV tensor(s), "
                             f"e.g. {missing[0]}")
    write_checkpoint(out, config, state, dtype)
    if tokenizer:
        load_tokenizer(source).save_pretrained(str(out))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    swift = config.swiftkv
    return ExportResult(out, base, swift.num_key_value_layers, swift.key_value_group_size, len(state), size)
