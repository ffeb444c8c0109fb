"""Distillation beyond Llama: a Gemma3 SwiftKV student's forward is the initialised SwiftKV
model's, every parameter belongs to one unit (what FSDP shards), training lowers the KL and
the export loads over the base; a Qwen2 student trains its biases too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from distill_helpers import (  # noqa: F401
    check_teacher_and_student,
    one_thread,
    parameter_owners,
    random_data,
    tiny_recipe,
    train_tiny,
)
from swiftkv_helpers import gemma3_across_kv_pair, qwen2_pair, random_base, swiftkv_model

from kvforge.config import SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.models.dense import dense_hidden_states, dense_logits
from kvforge.models.loader import load_model
from kvforge.models.swiftkv_checkpoint import swiftkv_tensor_names, write_checkpoint
from kvforge.tools.swiftkv.distill import check_recipe_against_model
from kvforge.tools.swiftkv.loss import distill_loss
from kvforge.tools.swiftkv.student import DistillModel

FIRST_LATER, GROUP = 2, 2  # later layers: a global pair, then a sliding pair


def gemma3_distill_model(train_later_layers: bool = False) -> DistillModel:
    return DistillModel(gemma3_across_kv_pair()[0], SwiftKVConfig(FIRST_LATER, GROUP), train_later_layers)


def test_teacher_and_student_equal_the_base_and_the_initialised_swiftkv_model():
    model = gemma3_distill_model()
    check_teacher_and_student(model, swiftkv_model(model.teacher, FIRST_LATER, GROUP, perturb=False))


def test_every_parameter_belongs_to_one_unit_and_the_trained_ones_get_gradients():
    """With train_later_layers: the four norms, MLP, o_proj and q_norm of each later layer and
    the leaders' k_norm copies train beside the SwiftKV tensors; nothing else gets a gradient."""
    model = gemma3_distill_model(train_later_layers=True)
    owners, rest, every = parameter_owners(model)
    assert every == set(owners) | rest and all(count == 1 for count in owners.values())

    later = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "self_attn.o_proj", "self_attn.q_norm", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    expected = set(swiftkv_tensor_names(model.student.config))
    expected |= {f"model.layers.{i}.{name}.weight" for i in range(FIRST_LATER, 6) for name in later}
    expected |= {f"model.layers.{i}.self_attn.k_norm.weight" for i in (2, 4)}
    assert set(model.trainable()) == expected
    data = random_data()
    counted = data.counted[:2]
    pair = model.forward_hidden(data.tokens[:2], data.segments[:2])
    distill_loss(pair, counted, model.student.model.norm, model.student.lm_head, float(counted.sum()),
                 2.0, 7).total.backward()
    with_grad = {name for name, p in model.student.named_parameters() if p.grad is not None}
    assert with_grad == expected
    assert all(p.grad is None for p in model.teacher.parameters())


def training_kl(model: DistillModel) -> float:
    """T^2 KL(teacher || student) over every row `train_tiny` trains on, without gradients."""
    data = random_data()
    with torch.no_grad():
        pair = model.forward_hidden(data.tokens, data.segments)
        return distill_loss(pair, data.counted, model.student.model.norm, model.student.lm_head,
                            float(data.counted.sum()), 2.0, 7).kl


def test_training_lowers_the_kl(tmp_path):
    model = gemma3_distill_model()
    before = training_kl(model)
    train_tiny(model, tiny_recipe(tmp_path, num_key_value_layers=FIRST_LATER, group_size=GROUP, max_steps=6))
    assert training_kl(model) < 0.85 * before


def test_a_soft_capped_teacher_is_refused():
    base = gemma3_across_kv_pair()[0]
    capped = random_base(replace(base.config, final_logit_softcapping=30.0))
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        DistillModel(capped, SwiftKVConfig(FIRST_LATER, GROUP))


def test_the_trained_student_exports_and_loads_over_its_base(tmp_path):
    """What `kvforge swiftkv distill` writes at its end: the params-only checkpoint, laid over
    the base, is the trained student (logits of the dense forward)."""
    model = gemma3_distill_model(train_later_layers=True)
    config = check_recipe_against_model(tiny_recipe(tmp_path, num_key_value_layers=FIRST_LATER, group_size=GROUP),
                                        model.teacher.config)
    base_dir = write_checkpoint(tmp_path / "base", model.teacher.config, model.teacher.state_dict(), torch.float32)
    train_tiny(model, tiny_recipe(tmp_path / "run", num_key_value_layers=FIRST_LATER, group_size=GROUP, max_steps=2))
    state = model.export_state()
    assert "model.layers.4.self_attn.k_norm.weight" in state  # trained with the later layers
    out = write_checkpoint(tmp_path / "swift", config, state, torch.float32, base_model=str(base_dir))
    loaded, _ = load_model(out)
    ids = random_data().tokens[:1]
    with torch.no_grad():
        torch.testing.assert_close(dense_logits(loaded, ids), dense_logits(model.student, ids), atol=1e-6, rtol=0)


def test_qwen2_student_trains_its_biases_and_lowers_the_kl(tmp_path):
    """Biased q_proj_swiftkv and leader K/V (AcrossKV over 3 layers: l = 1, g = 2): the student
    starts as the initialised SwiftKV model, the biases get gradients, and the KL falls."""
    model = DistillModel(qwen2_pair(3)[1], SwiftKVConfig(1, 2))
    assert {"model.layers.1.self_attn.q_proj_swiftkv.bias", "model.layers.1.self_attn.k_proj_swiftkv.bias",
            "model.layers.1.self_attn.v_proj_swiftkv.bias"} <= set(model.trainable())
    data = random_data()
    with torch.no_grad():
        reference = swiftkv_model(model.teacher, 1, 2, perturb=False)
        torch.testing.assert_close(model.forward_hidden(data.tokens[:2], data.segments[:2]).student,
                                   dense_hidden_states(reference, data.tokens[:2], data.segments[:2]),
                                   atol=1e-6, rtol=0)
    before = training_kl(model)
    train_tiny(model, tiny_recipe(tmp_path, num_key_value_layers=1, group_size=2, max_steps=6))
    assert training_kl(model) < 0.85 * before
