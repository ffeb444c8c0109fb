"""Teacher + student on one frozen copy of the weights, and the distillation loss."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from distill_helpers import (  # noqa: F401
    FIRST_LATER,
    GROUP,
    VOCAB,
    check_teacher_and_student,
    one_thread,
    random_data,
    tiny_distill_model,
)
from swiftkv_helpers import swiftkv_model

from kvforge.models.dense import dense_hidden_states, dense_logits
from kvforge.models.swiftkv_checkpoint import swiftkv_tensor_names
from kvforge.tools.swiftkv.loss import chunked_kl_sum, distill_loss, reference_kl_sum

LATER_MODULES = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def batch_loss(model, data, temperature=2.0, chunk=7, hidden_weight=0.0, hidden_layer=None):
    tokens, segments, counted = data.tokens[:3], data.segments[:3], data.counted[:3]
    pair = model.forward_hidden(tokens, segments, hidden_layer)
    student = model.student
    return pair, distill_loss(pair, counted, student.model.norm, student.lm_head, float(counted.sum()),
                              temperature, chunk, hidden_weight)


@pytest.mark.parametrize("train_later_layers", [False, True])
def test_only_the_listed_parameters_receive_gradients(train_later_layers):
    model = tiny_distill_model(train_later_layers=train_later_layers)
    config = model.student.config
    expected = set(swiftkv_tensor_names(config))
    if train_later_layers:
        expected |= {f"model.layers.{i}.{name}" for i in range(FIRST_LATER, config.num_layers) for name in LATER_MODULES}
    assert set(model.trainable()) == expected

    pair, parts = batch_loss(model, random_data())
    assert not pair.teacher.requires_grad  # the teacher path builds no graph at all
    parts.total.backward()
    with_grad = {name for name, p in model.student.named_parameters() if p.grad is not None}
    assert with_grad == expected
    for name in expected:
        assert model.trainable()[name].grad.abs().sum() > 0, name
    for name, p in model.teacher.named_parameters():
        assert not p.requires_grad and p.grad is None, name


def test_later_layers_are_shared_unless_trained():
    shared, private = tiny_distill_model(), tiny_distill_model(train_later_layers=True)
    for model, same in ((shared, True), (private, False)):
        later_s, later_t = model.student.model.layers[FIRST_LATER + 1], model.teacher.model.layers[FIRST_LATER + 1]
        assert (later_s.mlp is later_t.mlp) is same
        assert model.student.model.layers[0] is model.teacher.model.layers[0]  # layers < l: always one copy
        torch.testing.assert_close(later_s.mlp.up_proj.weight, later_t.mlp.up_proj.weight, rtol=0, atol=0)


def test_teacher_and_student_equal_the_base_and_the_initialised_swiftkv_model():
    model = tiny_distill_model()
    # the reference: `swiftkv init`'s tensors in the engine's class
    check_teacher_and_student(model, swiftkv_model(model.teacher, FIRST_LATER, GROUP, perturb=False))


def hand_loss(teacher_logits, student_logits, counted, temperature, hidden=None, weight=0.0):
    """T^2 * KL(p || q) and the MSE, with Python loops in float64 over the counted positions."""
    total, count = 0.0, 0
    for b in range(counted.shape[0]):
        for t in range(counted.shape[1]):
            if not counted[b, t]:
                continue
            count += 1
            zt = [float(x) / temperature for x in teacher_logits[b, t]]
            zs = [float(x) / temperature for x in student_logits[b, t]]
            lt = math.log(sum(math.exp(v) for v in zt))
            ls = math.log(sum(math.exp(v) for v in zs))
            total += temperature ** 2 * sum(math.exp(a - lt) * ((a - lt) - (c - ls)) for a, c in zip(zt, zs))
            if hidden is not None:
                hs, ht = hidden
                total += weight * float(((hs[b, t].double() - ht[b, t].double()) ** 2).mean())
    return total / count


@pytest.mark.parametrize(("temperature", "hidden_weight", "hidden_layer"), [(2.0, 0.0, None), (1.0, 0.0, None),
                                                                          (2.0, 0.5, 3)])
def test_loss_equals_a_hand_computation(temperature, hidden_weight, hidden_layer):
    model = tiny_distill_model()
    reference = swiftkv_model(model.teacher, FIRST_LATER, GROUP, perturb=False)
    data = random_data()
    tokens, segments, counted = data.tokens[:3], data.segments[:3], data.counted[:3]
    assert 0 < counted.sum() < counted.numel()  # a mask with holes, and segments inside rows
    with torch.no_grad():
        hidden = None
        if hidden_weight:
            hidden = (dense_hidden_states(reference, tokens, segments, output_layer=hidden_layer),
                      dense_hidden_states(model.teacher, tokens, segments, output_layer=hidden_layer))
        expected = hand_loss(dense_logits(model.teacher, tokens, segments), dense_logits(reference, tokens, segments),
                             counted, temperature, hidden, hidden_weight)
    _, parts = batch_loss(model, data, temperature, hidden_weight=hidden_weight, hidden_layer=hidden_layer)
    total = float(parts.total.detach())
    assert total == pytest.approx(expected, rel=1e-5)
    assert parts.kl + parts.hidden_mse == pytest.approx(total, rel=1e-6)
    assert (parts.hidden_mse > 0) == (hidden_weight > 0)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_kl_matches_the_reference_in_value_and_gradient(chunk):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, VOCAB, bias=True).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, 16, generator=generator))
        head.bias.copy_(torch.randn(VOCAB, generator=generator))
    student = torch.randn(11, 16, generator=generator, requires_grad=True)
    teacher = torch.randn(11, 16, generator=generator)
    got = chunked_kl_sum(student, teacher, head, 2.0, chunk)
    (got * 0.3).backward()
    grad = student.grad.clone()
    student.grad = None
    want = reference_kl_sum(head(student), head(teacher), 2.0)
    (want * 0.3).backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, student.grad, rtol=1e-4, atol=1e-6)


def test_kl_is_zero_for_identical_models_and_a_trainable_head_is_refused():
    head = torch.nn.Linear(8, VOCAB).requires_grad_(False)
    x = torch.randn(4, 8)
    assert float(chunked_kl_sum(x, x, head, 2.0, 3)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="frozen"):
        chunked_kl_sum(x, x, head.requires_grad_(True), 2.0, 3)


def test_a_swiftkv_model_cannot_be_the_teacher():
    model = tiny_distill_model()
    from kvforge.errors import ConfigError
    from kvforge.tools.swiftkv.student import DistillModel

    with pytest.raises(ConfigError, match="base Llama"):
        DistillModel(model.student, replace(model.swift))
