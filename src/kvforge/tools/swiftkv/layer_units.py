"""The distillation forward as a stack of per-layer modules, so FSDP can shard it.

`DistillModel.forward_hidden` runs through a `DistillStack`: the embedding, then one
`LayerUnit` per layer, and before layer l the `SwiftKVInputUnit` that computes the later
layers' K/V. Each unit owns, as submodules, exactly the parameters its forward reads:

- `LayerUnit(i)`: the teacher's layer i (shared with the student: for i < l the whole layer,
  for i >= l its norms, o_proj and MLP) and, for a later layer, the student's own parameters
  of that layer (`q_proj_swiftkv`; with `train_later_layers` also its private norms, o_proj
  and MLP);
- `SwiftKVInputUnit`: `norm_swiftkv` and every group leader's `k/v_proj_swiftkv` and, with
  QK-norm, the student's copy of its `k_norm` (all read at layer l, so one unit gathers
  them together);
- the stack itself: the embedding, the final norm and the head (read again by the loss),
  and the early-exit head's norm and projection when one is trained.

Invariants: every parameter of the teacher and the student belongs to exactly one unit or to
the stack (so `fully_shard` on each unit and then on the stack shards all of them once); the
stack computes exactly what the per-model dense forward (`dense_layers`) computes, op for op,
with the teacher under no_grad and layers < l run once for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kvforge.config import SwiftKVConfig
from kvforge.models.causal_lm import CausalLM
from kvforge.models.dense import DenseInputs, LaterKV, dense_inputs, dense_layer, swiftkv_later_kv
from kvforge.models.swiftkv import SwiftKVForCausalLM


class DistillPair(Protocol):
    """What the units are cut from (student.DistillModel): the frozen teacher, the student
    wired on its modules, the SwiftKV setting and what trains."""

    teacher: CausalLM
    student: SwiftKVForCausalLM
    swift: SwiftKVConfig
    train_later_layers: bool
    early_exit_only: bool


@dataclass(frozen=True)
class HiddenPair:
    """Final hidden states (before the final norm) of teacher and student, [B, S, hidden],
    and both inputs of the hidden-loss layer when one was asked for."""

    teacher: torch.Tensor
    student: torch.Tensor | None  # None when only the early-exit head trains
    teacher_at: torch.Tensor | None = None
    student_at: torch.Tensor | None = None
    # The early-exit head's hidden state (before the final norm) when the student has one.
    student_early: torch.Tensor | None = None


def later_layer_modules(layer: nn.Module) -> list[str]:
    """A later layer's modules other than its attention: norms and MLP (two norms in Llama,
    four in Gemma3), the teacher's or, with train_later_layers, private copies."""
    return [name for name, _ in layer.named_children() if name != "self_attn"]


class LayerUnit(nn.Module):
    """Layer `index` of teacher (no grad) and student (grad, from layer l on)."""

    def __init__(self, model: DistillPair, index: int, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.index = index
        self.is_later = model.swift.is_later(index)
        self.activation_checkpointing = activation_checkpointing
        self.teacher_layer = model.teacher.model.layers[index]
        own: dict[str, nn.Module] = {}
        if self.is_later:
            layer = model.student.model.layers[index]
            own["q_proj_swiftkv"] = layer.self_attn.q_proj_swiftkv
            if model.train_later_layers:  # private trainable copies, not the teacher's modules
                own.update({name: getattr(layer, name) for name in later_layer_modules(layer)})
                own["o_proj"] = layer.self_attn.o_proj
                if layer.self_attn.q_norm is not None:
                    own["q_norm"] = layer.self_attn.q_norm
        self.student_own = nn.ModuleDict(own)
        self._models = (model.teacher, model.student)  # a tuple: not registered as submodules

    def forward(self, inputs: DenseInputs, teacher_hidden: torch.Tensor, student_hidden: torch.Tensor | None,
                later_kv: LaterKV) -> tuple[torch.Tensor, torch.Tensor | None]:
        teacher, student = self._models
        with torch.no_grad():
            teacher_out = dense_layer(teacher, self.index, inputs, teacher_hidden)
        if student_hidden is None:  # layers < l: the student's are the teacher's, run once
            return teacher_out, None
        if self.activation_checkpointing and torch.is_grad_enabled():
            student_out = checkpoint(dense_layer, student, self.index, inputs, student_hidden, later_kv,
                                     use_reentrant=False)
        else:
            student_out = dense_layer(student, self.index, inputs, student_hidden, later_kv)
        return teacher_out, student_out


class SwiftKVInputUnit(nn.Module):
    """`norm_swiftkv` and the group leaders' K/V projections: the later layers' caches."""

    def __init__(self, model: DistillPair) -> None:
        super().__init__()
        student = model.student
        self.norm_swiftkv = student.model.norm_swiftkv
        leaders = [student.model.layers[i].self_attn for i in model.swift.leaders(student.config.num_layers)]
        self.projections = nn.ModuleList(module for attn in leaders for module in (attn.k_proj_swiftkv, attn.v_proj_swiftkv))
        self.key_norms = nn.ModuleList(attn.k_norm for attn in leaders if attn.k_norm is not None)
        self._student = (student,)

    def forward(self, inputs: DenseInputs, hidden: torch.Tensor) -> LaterKV:
        return swiftkv_later_kv(self._student[0], inputs, hidden)


class DistillStack(nn.Module):
    """Embedding, per-layer units and the SwiftKV input unit; its forward is the pair of
    final hidden states (and the hidden-loss layer's inputs when asked)."""

    def __init__(self, model: DistillPair, activation_checkpointing: bool = False) -> None:
        super().__init__()
        teacher = model.teacher
        self.embed_tokens = teacher.model.embed_tokens
        self.norm = teacher.model.norm
        self.lm_head = teacher.lm_head
        self.units = nn.ModuleList(LayerUnit(model, i, activation_checkpointing)
                                   for i in range(teacher.config.num_layers))
        self.swiftkv_inputs = SwiftKVInputUnit(model)
        student = model.student.model
        # The early-exit head (when trained) reads the trunk's output: gathered with the stack.
        self.early_exit = student.early_exit_proj \
            if model.swift.early_exit_head else None
        self.first_later = model.swift.num_key_value_layers
        # Training the early-exit head alone needs no student past layer l (its loss reads h_l).
        self.student_needed = not model.early_exit_only
        self._teacher = (teacher,)

    def forward(self, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                hidden_layer: int | None = None, autocast: bool = False) -> HiddenPair:
        teacher = self._teacher[0]
        captured: dict[str, torch.Tensor] = {}
        with torch.autocast(token_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                # [B * S, hidden] throughout: every unit's output is a tensor of its own (no view)
                hidden = teacher.embed(token_ids.reshape(-1))
                inputs = dense_inputs(teacher, token_ids, segment_ids, hidden.dtype)
            student, later_kv, early = None, {}, None
            for unit in self.units:
                if unit.index == self.first_later:
                    student = hidden if self.student_needed else None  # both continue from the trunk
                    later_kv = self.swiftkv_inputs(inputs, hidden) if self.student_needed else {}
                    if self.early_exit is not None:
                        early = self.early_exit(hidden)
                if unit.index == hidden_layer:
                    captured.update(teacher=hidden, student=student)
                hidden, student = unit(inputs, hidden, student, later_kv)
            if hidden_layer == len(self.units):
                captured.update(teacher=hidden, student=student)
        return HiddenPair(hidden, student, captured.get("teacher"), captured.get("student"), early)
