"""ModelConfig -> its family's decoder class (SwiftKV configs get the SwiftKV variant), and
what follows from the class alone: the model, its parameter count."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
from torch import nn

from kvforge.config import ModelConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.family import family_of


def model_class(config: ModelConfig) -> type[CausalLM]:
    """ConfigError when `config.architecture` names no registered family."""
    return family_of(config).model_class(config.swiftkv is not None)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", initialise: bool = True) -> CausalLM:
    """A model of the configured architecture, in eval mode. `initialise=False` skips the
    random initialisation of its linear and embedding weights (left as allocated memory): for
    a caller that overwrites every parameter next (a checkpoint's load, which refuses a
    missing tensor, or the dummy draw), where it took 1.5 s of every smollm2 load and 4 s of
    gemma3-270m's."""
    with nullcontext() if initialise else _initialisation_skipped():
        return model_class(config)(config, dtype=dtype, device=device).eval()


_init_lock = threading.Lock()


@contextmanager
def _initialisation_skipped() -> Iterator[None]:
    """nn.Linear and nn.Embedding (the only initialised modules of the families) built without
    `reset_parameters` in this block. It patches the classes, so one build at a time holds
    the lock, and the patch is undone on any exit."""
    with _init_lock:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _leave_as_allocated
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _leave_as_allocated(module: nn.Module) -> None:
    del module


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the base model (SwiftKV fields ignored; a tied embedding counted once),
    counted on the family's own modules built on the meta device, so no formula per family
    can drift from the layers."""
    # initialise=False: a meta tensor's normal_ runs through torch._refs, whose first call
    # imports torch._dynamo (2 s of `kvforge info` on a 2-core EPYC) to draw nothing
    model = build_model(replace(config, swiftkv=None), device="meta", initialise=False)
    return sum(p.numel() for p in model.parameters())
