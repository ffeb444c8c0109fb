"""The llama.cpp peer as `--compare` names it: `llama.cpp[:WEIGHTS]` parsed to its weights
(WEIGHTS, see llamacpp_peer.py), and what is checked before anything loads. Imports
nothing of llama.cpp: whether llama-cpp-python is installed is found, not imported."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from kvforge.errors import require
from kvforge.tools.bench.systems import System

PEER = "llama.cpp"
# llama_ftype of each converted weight type (llama.h); None: the source file itself
WEIGHTS: dict[str, int | None] = {"f16": 1, "bf16": 32, "f32": 0, "as-shipped": None}
DEFAULT_WEIGHTS = "f16"
INSTALL = ("pip install -e '.[peers]' (it builds llama-cpp-python, compiling llama.cpp from source: "
           "a few minutes; see docs/benchmarks.md)")
VERBS = "`kvforge bench prefill` and `kvforge bench decode`"


def is_peer(item: str) -> bool:
    """Whether a --compare entry names this peer (`llama.cpp` or `llama.cpp:WEIGHTS`)."""
    return item == PEER or item.startswith(PEER + ":")


def parse(item: str, allowed: bool = True) -> str:
    """A --compare entry -> its weights; ConfigError when this verb has no llama.cpp peer,
    the weights are unknown, or llama-cpp-python is not installed."""
    require(allowed, "compare", item, f"the llama.cpp peer runs in {VERBS} only")
    _, colon, weights = item.partition(":")
    weights = weights if colon else DEFAULT_WEIGHTS
    require(weights in WEIGHTS, "compare", item,
            f"llama.cpp weights must be one of {', '.join(WEIGHTS)} (llama.cpp means llama.cpp:{DEFAULT_WEIGHTS})")
    require(installed(), "compare", item, f"the llama.cpp peer needs the llama-cpp-python package: {INSTALL}")
    return weights


def installed() -> bool:
    """Whether llama_cpp can be found (found, not imported: importing loads the library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def system_name(weights: str) -> str:
    return f"{PEER}[{weights}]"


def check_run(systems: Sequence[System], source_kind: str, device: str) -> None:
    """Before anything loads: llama.cpp reads GGUF files and runs on the CPU (this build)."""
    for system in systems:
        if system.kind != PEER:
            continue
        require(source_kind == "gguf", "compare", system.name,
                "the llama.cpp peer needs a GGUF model (a named model or a .gguf file as --model)")
        require(device == "cpu", "device", device, "the llama.cpp peer runs on the CPU: use --device cpu")
