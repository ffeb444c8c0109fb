"""Random weights for `--load-format dummy` (vLLM's name): a model's real shapes without its
checkpoint, for measuring speed only (its outputs mean nothing).

Each parameter is drawn from its Hugging Face name and shape alone, with a generator seeded
by (seed, name), so
- the same seed gives the same weights, in any order and whichever subset is asked for
  (`swiftkv init` reads only a few tensors);
- kvforge's model and the transformers peer, whose parameters have the same names and
  shapes, get the same weights (`fill_dummy_weights` on either);
- the values are drawn on the parameter's device (no host copy of an 8B model); a CUDA
  generator draws other numbers than the CPU one, so weights equal only on one device.
Values are drawn in float32 and rounded to the parameter's dtype, so a bf16 model holds the
rounded float32 one.

Scales: a matrix of fan-in n is drawn N(0, (gain / sqrt(n))^2), the embedding at a fixed std,
norm weights so that the norm scales by 1, biases 0. The gains are std * sqrt(fan-in) of the
real checkpoints here (dequantised GGUF, averaged over layers; measured with
`load_state_dict` on the named models): the `llama` family from smollm2-135m (Q4_1), whose
weights are large for their width, so activations at 8B width are larger than a real 8B's
but stay finite in bf16 (tests/models/test_dummy_weights.py); `gemma3` from gemma3-270m
(Q4_K_M). No checkpoint here has attention biases to measure: they are 0.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from kvforge.config import ModelConfig
from kvforge.errors import ModelLoadError

DUMMY_SEED = 0


@dataclass(frozen=True)
class WeightScale:
    """How one family's weights are drawn: `gains` by module name (a SwiftKV copy such as
    `q_proj_swiftkv` takes its original's), `default_gain` for any other matrix."""

    embedding_std: float
    norm_weight: float  # the stored value under which a norm scales by 1 (Gemma's scale by 1 + w)
    gains: Mapping[str, float] = field(default_factory=dict)
    default_gain: float = 1.0


SCALES: dict[str, WeightScale] = {
    # smollm2-135m: embedding std 0.136 (tied, so also the head's: 0.136 * sqrt(576) = 3.25)
    "llama": WeightScale(embedding_std=0.136, norm_weight=1.0, gains={
        "q_proj": 4.80, "k_proj": 4.94, "v_proj": 4.54, "o_proj": 4.20,
        "gate_proj": 4.50, "up_proj": 4.78, "down_proj": 7.52, "lm_head": 3.25}),
    # gemma3-270m: every projection at about 1 / sqrt(fan-in)
    "gemma3": WeightScale(embedding_std=0.041, norm_weight=0.0, gains={
        "q_proj": 1.00, "k_proj": 1.00, "v_proj": 1.00, "o_proj": 0.96,
        "gate_proj": 1.00, "up_proj": 1.00, "down_proj": 0.73, "lm_head": 1.03}),
}
# A family registered elsewhere: unit gains, embedding rows of norm about 1.
_UNIT = WeightScale(embedding_std=0.0, norm_weight=1.0)


def weights_label(seed: int) -> str:
    """What results say about the weights of a dummy model."""
    return f"dummy (random, seed {seed})"


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (1 << 63)


def draw(name: str, shape: torch.Size | tuple[int, ...], config: ModelConfig, seed: int,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 value of parameter `name` (Hugging Face naming) of a dummy `config` model."""
    scale = SCALES.get(config.architecture, _UNIT)
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    if kind == "bias":
        return torch.zeros(shape, device=device)
    if "norm" in module:
        return torch.full(shape, scale.norm_weight, device=device)
    if module == "embed_tokens":
        std = scale.embedding_std or 1.0 / math.sqrt(shape[-1])
    elif len(shape) == 2:
        std = scale.gains.get(module.removesuffix("_swiftkv"), scale.default_gain) / math.sqrt(shape[-1])
    else:
        raise ModelLoadError(f"--load-format dummy has no rule for the parameter {name} of shape {tuple(shape)}")
    generator = torch.Generator(device=device)
    generator.manual_seed(_tensor_seed(seed, name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, config: ModelConfig, seed: int = DUMMY_SEED) -> None:
    """Overwrite every parameter of `model` (kvforge's or transformers') with its draw."""
    for name, parameter in model.named_parameters():
        parameter.copy_(draw(name, parameter.shape, config, seed, parameter.device))


class DummyState(Mapping[str, torch.Tensor]):
    """The HF-named state dict of a dummy `config` model, each tensor drawn when read (on the
    CPU, in `dtype`), so a reader of a few tensors never holds the whole model."""

    def __init__(self, config: ModelConfig, seed: int = DUMMY_SEED, dtype: torch.dtype = torch.float32) -> None:
        from kvforge.models.registry import build_model  # lazy: the registry imports the model zoo

        meta = build_model(config, device="meta", initialise=False)  # shapes only: nothing to draw
        self._shapes = {name: p.shape for name, p in meta.named_parameters()}
        if config.tie_word_embeddings:  # a checkpoint names the tied head too
            self._shapes.setdefault("lm_head.weight", self._shapes["model.embed_tokens.weight"])
        self._config, self._seed, self._dtype = config, seed, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self._config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        return draw(name, self._shapes[name], self._config, self._seed).to(self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)
