"""Teacher and student of SwiftKV knowledge recovery on ONE frozen copy of the base weights.

The teacher is its family's base CausalLM (Llama, Gemma3, ...: original wiring,
requires_grad off). The student is its SwiftKV variant whose modules are the teacher's own
(embedding, layers < l, the later layers' norms, o_proj, q_norm and MLP, final norm, head;
a leader's k_norm is a frozen copy, read with the leaders' K/V), plus the trainable
SwiftKV parameters under the checkpoint's names: `model.norm_swiftkv`, every later layer's
`self_attn.q_proj_swiftkv` and the group leaders' `self_attn.k_proj_swiftkv` /
`v_proj_swiftkv`. With `train_later_layers` the later layers' norms, o_proj and MLP are
private trainable copies instead (the paper's full-vs-partial ablation).

Layers < l are the same modules in both, so a batch runs them once (no grad): the teacher
continues from layer l with its own wiring, the student from the same hidden state with
the SwiftKV wiring and autograd on (`forward_hidden`).
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import torch
from torch import nn

from kvforge.config import SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.models.causal_lm import CausalLM
from kvforge.models.family import family_of
from kvforge.models.registry import model_class
from kvforge.models.swiftkv import SwiftKVForCausalLM
from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors, swiftkv_tensor_names
from kvforge.tools.swiftkv.layer_units import DistillStack, HiddenPair, later_layer_modules
from kvforge.tools.swiftkv.sharding import full_tensor, shard_like


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                      device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


class DistillModel(nn.Module):
    def __init__(self, base: CausalLM, swift: SwiftKVConfig, train_later_layers: bool = False,
                 init: dict[str, torch.Tensor] | None = None, activation_checkpointing: bool = False,
                 early_exit_only: bool = False) -> None:
        super().__init__()
        teacher_class = family_of(base.config).causal_lm
        if type(base) is not teacher_class:
            raise ConfigError("model", type(base).__name__, f"the teacher must be its family's base model "
                                                            f"({teacher_class.__name__}: base Llama-family, Gemma3, "
                                                            f"...), not a SwiftKV checkpoint")
        if base.config.final_logit_softcapping:
            raise ConfigError("final_logit_softcapping", base.config.final_logit_softcapping,
                              "distillation's chunked KL reads the head's plain logits: soft-capped models "
                              "are not supported")
        config = replace(base.config, swiftkv=swift)  # validates l and g against the layer count
        base.requires_grad_(False)
        self.teacher = base.eval()
        self.swift = swift
        self.train_later_layers = train_later_layers
        self.early_exit_only = early_exit_only
        if init is None:
            init = initial_swiftkv_tensors(base.state_dict(), base.config, swift)
        self.student = self._build_student(config, init).eval()
        if early_exit_only:  # the SwiftKV tensors stay as loaded; only the early-exit head trains
            if not swift.early_exit_head:
                raise ConfigError("early-exit-only", True, "needs early-exit-head")
            for name, p in self.student.named_parameters():
                if "early_exit" not in name:
                    p.requires_grad_(False)
        # The forward, layer by layer: the units FSDP shards (kvforge.tools.swiftkv.sharding).
        self.stack = DistillStack(self, activation_checkpointing)

    def _build_student(self, config, init: dict[str, torch.Tensor]) -> SwiftKVForCausalLM:
        base = self.teacher
        # Built on the meta device: every module is replaced by a shared or a new one below.
        student = model_class(config)(config, dtype=base.dtype, device="meta")
        student.rotaries = base.rotaries
        for name, buffer in base.named_buffers(recurse=False):  # Gemma3's embedding scale
            setattr(student, name, buffer)
        student.model.embed_tokens = base.model.embed_tokens
        student.model.norm = base.model.norm
        student.lm_head = base.lm_head
        first = self.swift.num_key_value_layers
        for index in range(config.num_layers):
            if index < first:
                student.model.layers[index] = base.model.layers[index]
                continue
            mine, theirs = student.model.layers[index], base.model.layers[index]
            for name in later_layer_modules(mine):
                setattr(mine, name, self._later(getattr(theirs, name)))
            mine.self_attn.o_proj = self._later(theirs.self_attn.o_proj)
            if mine.self_attn.q_norm is not None:  # QK-norm (Gemma3): the layer's own q_norm
                mine.self_attn.q_norm = self._later(theirs.self_attn.q_norm)
            if mine.self_attn.k_norm is not None:
                # A leader's k_norm is read with the K/V projections at layer l (SwiftKVInputUnit):
                # a copy, so no parameter is shared between two units; trained with the later layers.
                mine.self_attn.k_norm = copy.deepcopy(theirs.self_attn.k_norm).requires_grad_(self.train_later_layers)
            prefix = f"model.layers.{index}.self_attn."
            kinds = ("q_proj_swiftkv", "k_proj_swiftkv", "v_proj_swiftkv") if self.swift.is_leader(index) \
                else ("q_proj_swiftkv",)
            for kind in kinds:
                bias = init.get(prefix + kind + ".bias")
                setattr(mine.self_attn, kind, _linear(init[prefix + kind + ".weight"].to(base.dtype),
                                                      None if bias is None else bias.to(base.dtype)))
        norm = student.make_norm(config.hidden_size, base.dtype, base.lm_head.weight.device)
        with torch.no_grad():
            norm.weight.copy_(init["model.norm_swiftkv.weight"])
        student.model.norm_swiftkv = norm
        if self.swift.early_exit_head:  # trainable: early_exit_proj
            student.model.early_exit_proj = _linear(init["model.early_exit_proj.weight"].to(base.dtype), None)
        leftover = [name for name, p in student.named_parameters() if p.is_meta]
        if leftover:  # a module the student has but the wiring above forgot
            raise RuntimeError(f"student parameters left unset: {leftover[:4]}")
        return student

    def _later(self, module: nn.Module) -> nn.Module:
        """A later layer's module: the teacher's (frozen) or a trainable private copy."""
        if not self.train_later_layers:
            return module
        return copy.deepcopy(module).requires_grad_(True)

    # -- parameters -------------------------------------------------------------------
    def trainable(self) -> dict[str, nn.Parameter]:
        """Trainable parameters by checkpoint name (sorted, so optimizer states line up)."""
        named = dict(self.student.named_parameters())
        return {name: named[name] for name in sorted(named) if named[name].requires_grad}

    def export_state(self) -> dict[str, torch.Tensor]:
        """What a params-only checkpoint holds: every SwiftKV tensor (trained or kept frozen)
        and every other trained tensor, full; a collective under FSDP."""
        names = set(swiftkv_tensor_names(self.student.config)) | set(self.trainable())
        return {name: full_tensor(self.student.get_parameter(name).detach()).clone() for name in sorted(names)}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) copies; under FSDP a collective: every process must call it."""
        return {name: full_tensor(p.detach()).clone() for name, p in self.trainable().items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = self.trainable()
        if set(state) != set(params):
            raise ConfigError("training state", sorted(set(state) ^ set(params))[:4],
                              "does not hold exactly this student's trainable parameters")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(shard_like(state[name], p))

    # -- forward ----------------------------------------------------------------------
    def forward_hidden(self, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                       hidden_layer: int | None = None, autocast: bool = False) -> HiddenPair:
        """Teacher (no grad) and student (grad) hidden states for one batch; layers < l once.
        The stack works on [B * S, hidden] rows (an FSDP module's outputs must not be views);
        the pair comes back as [B, S, hidden]."""
        pair = self.stack(token_ids, segment_ids, hidden_layer, autocast)
        shape = (*token_ids.shape, -1)
        return HiddenPair(*(None if (t := getattr(pair, f.name)) is None else t.view(shape) for f in fields(pair)))
