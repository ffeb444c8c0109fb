"""`kvforge swiftkv memory`: the parameter counts behind the estimate are those of the real
teacher and student, and the parts scale with processes and tokens as stated."""

from __future__ import annotations

from pathlib import Path

import pytest
from distill_helpers import tiny_distill_model

from kvforge.cli import main
from kvforge.config import SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.tools.swiftkv.fsdp_memory import (
    fsdp_memory,
    layer_parameters,
    stack_parameters,
    swiftkv_parameters,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize(("first", "group"), [(1, 2), (2, 1), (1, 1)])
def test_counts_match_the_distillation_model(first, group):
    model = tiny_distill_model(first, group)
    config = model.teacher.config
    teacher = sum(p.numel() for p in model.teacher.parameters())
    assert stack_parameters(config) + config.num_layers * layer_parameters(config) == teacher
    trained, inputs = swiftkv_parameters(config, SwiftKVConfig(first, group))
    assert trained == sum(p.numel() for p in model.trainable().values())
    assert inputs == sum(p.numel() for p in model.stack.swiftkv_inputs.parameters())


def test_sharded_parts_shrink_with_processes_and_activations_grow_with_tokens():
    config = tiny_distill_model().teacher.config
    swift = SwiftKVConfig(1, 2)
    one, eight = fsdp_memory(config, swift, 1, 512), fsdp_memory(config, swift, 8, 512)
    assert eight.sharded_parameters == pytest.approx(one.sharded_parameters / 8)
    assert eight.gradients_and_adam == pytest.approx(one.gradients_and_adam / 8)
    assert eight.gathered_parameters == one.gathered_parameters
    assert fsdp_memory(config, swift, 8, 1024).activations == pytest.approx(2 * eight.activations)
    kept = fsdp_memory(config, swift, 8, 512, activation_checkpointing=False)
    assert kept.activations > eight.activations


def test_memory_command_prints_the_breakdown(capsys):
    assert main(["swiftkv", "memory", "--config", str(EXAMPLES / "llama-3.1-8b-config.json"),
                 "--num-key-value-layers", "16", "--processes", "8"]) == 0
    out = capsys.readouterr().out
    assert "total (estimate)" in out and "8 processes" in out
    with pytest.raises(ConfigError, match="processes"):
        fsdp_memory(tiny_distill_model().teacher.config, SwiftKVConfig(1, 2), 0, 512)


def test_the_example_fsdp_recipe_is_a_valid_recipe():
    from kvforge.tools.swiftkv.recipe import DistillRecipe, load_recipe_file

    recipe = DistillRecipe(**load_recipe_file(EXAMPLES / "recipes" / "llama-3.1-8b-swiftkv-l16-fsdp.yaml"))
    assert recipe.fsdp and recipe.fsdp_mixed_precision == "bfloat16" and recipe.activation_checkpointing
    assert recipe.num_key_value_layers == 16 and recipe.device == "cuda"
