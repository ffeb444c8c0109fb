"""The analysis API: capture one passage's activations once, run the requested analyses
on them, write each one's JSON (numbers) and PNG (figure) into an output directory.

Works on any prebuilt kvforge model (no loading here), so tests pass tiny models.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.errors import require
from kvforge.models.causal_lm import CausalLM
from kvforge.tools.analysis import KINDS
from kvforge.tools.analysis.capture import Activations, capture_activations
from kvforge.tools.analysis.channels import kv_channels, summarise_kv_channels
from kvforge.tools.analysis.plots import plot_key_spectra, plot_kv_channels, plot_layer_similarity
from kvforge.tools.analysis.similarity import layer_similarity, summarise_layer_similarity
from kvforge.tools.analysis.spectra import key_spectra, summarise_key_spectra

JSON_DIGITS = 6  # enough for every figure; keeps the spectra JSON small


@dataclass(frozen=True)
class AnalysisSettings:
    kinds: tuple[str, ...] = KINDS
    layer: int | None = None  # representative layer of kv-channels; None: the middle layer

    def __post_init__(self) -> None:
        require(len(self.kinds) >= 1 and set(self.kinds) <= set(KINDS), "kinds", self.kinds,
                f"must be a non-empty selection of {', '.join(KINDS)}")
        require(self.layer is None or self.layer >= 0, "layer", self.layer, "must be >= 0")


@dataclass(frozen=True)
class AnalysisOutput:
    kind: str
    result: dict[str, Any]
    summary: str
    json_path: Path
    png_path: Path


@dataclass(frozen=True)
class _Kind:
    compute: Callable[[Activations, AnalysisSettings], dict[str, Any]]
    summarise: Callable[[dict[str, Any]], str]
    plot: Callable[[dict[str, Any], str, Path], None]


def _representative_layer(acts: Activations, settings: AnalysisSettings) -> int:
    return acts.num_layers // 2 if settings.layer is None else settings.layer


_KINDS: dict[str, _Kind] = {
    "layer-similarity": _Kind(lambda acts, _: layer_similarity(acts.hidden), summarise_layer_similarity,
                              plot_layer_similarity),
    "key-spectra": _Kind(lambda acts, _: key_spectra(acts), summarise_key_spectra, plot_key_spectra),
    "kv-channels": _Kind(lambda acts, s: kv_channels(acts, _representative_layer(acts, s)), summarise_kv_channels,
                         plot_kv_channels),
}


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, JSON_DIGITS)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def analyze(model: CausalLM, token_ids: Sequence[int], out_dir: str | Path, title: str,
            settings: AnalysisSettings = AnalysisSettings(), metadata: dict[str, Any] | None = None,
            ) -> list[AnalysisOutput]:
    """Run `settings.kinds` on one passage; writes `<kind>.json` and `<kind>.png` (kind with
    underscores) into `out_dir`. `metadata` (model name, text file, ...) goes into each JSON."""
    layers = model.config.num_layers
    require(settings.layer is None or settings.layer < layers, "layer", settings.layer,
            f"must be < the model's {layers} layers")  # checked before the forward pass
    acts = capture_activations(model, token_ids)
    windows = [model.config.window_of(layer) for layer in range(model.config.num_layers)]
    # Marked in the figures where a model mixes sliding-window and global layers (Gemma3).
    global_layers = [i for i, w in enumerate(windows) if w is None] if any(w is not None for w in windows) else []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    outputs = []
    for kind in settings.kinds:
        spec = _KINDS[kind]
        result = {**spec.compute(acts, settings), "global_layers": global_layers}
        stem = kind.replace("-", "_")
        json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
        payload = {"analysis": kind, **(metadata or {}), "num_tokens": acts.num_tokens, **result}
        json_path.write_text(json.dumps(_rounded(payload)) + "\n")
        spec.plot(result, title, png_path)
        outputs.append(AnalysisOutput(kind, result, spec.summarise(result), json_path, png_path))
    return outputs
