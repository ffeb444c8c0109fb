"""Checks a command makes before it loads any weights: lengths against the model's context
(read from its config alone), optional backends importable (naming the extra or package
that installs them), prompts that can never run. Each failure is a ConfigError naming the
parameter, the value and the rule, so the CLI exits 2 in a second, not after a load."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from kvforge.errors import ConfigError, require

# Optional backend -> (module to import, what installs it)
BACKENDS = {
    "quanto": ("optimum.quanto", "pip install optimum-quanto"),
    "hqq": ("hqq", "pip install hqq"),
    "lm-eval": ("lm_eval", "pip install 'kvforge[lm-eval]'"),
    "triton": ("triton", "pip install 'kvforge[triton]'"),
    "serve": ("fastapi", "pip install 'kvforge[serve]'"),
}


def model_context(model: str, swiftkv: str | None = None, max_position_embeddings: int | None = None,
                  load_format: str = "auto") -> int:
    """The model's context in tokens, from its configuration only (no weights)."""
    from kvforge.models.loader import load_model_config, resolve_model_source

    if max_position_embeddings:
        return max_position_embeddings
    config = load_model_config(resolve_model_source(model, load_format))
    if swiftkv:
        from pathlib import Path

        require(Path(swiftkv).expanduser().is_dir(), "swiftkv", swiftkv,
                "must be a SwiftKV checkpoint directory (see kvforge swiftkv init)")
        from kvforge.models.swiftkv_checkpoint import overlay_config

        config = overlay_config(config, swiftkv)
    return config.max_position_embeddings


def check_within_context(parameter: str, values: Iterable[int], context: int, model: str, extra: int = 0,
                         extra_what: str = "") -> None:
    """Every value (+ `extra`, e.g. tokens to generate) fits the model's context."""
    for value in values:
        require(value + extra <= context, parameter, value,
                f"must be <= {context - extra}: {model}'s context is {context} tokens"
                + (f" and {extra} {extra_what} come on top" if extra else ""))


def require_backend(name: str, parameter: str, value: Any) -> None:
    """ConfigError unless the optional backend `name` (BACKENDS) is importable."""
    module, install = BACKENDS[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        found = False
    if not found:
        raise ConfigError(parameter, value, f"needs the {name} backend ({module} is not installed): {install}")


def require_prompts(prompts: Iterable[str], parameter: str = "prompt") -> None:
    for prompt in prompts:
        require(isinstance(prompt, str) and prompt != "", parameter, prompt, "must not be empty")
