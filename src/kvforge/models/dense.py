"""Dense, cache-free forward of Llama-family and Gemma3 models, SwiftKV or not, over whole
sequences.

Every token runs every layer (for a SwiftKV model: with the SwiftKV wiring, i.e. later
layers take K/V from `norm_swiftkv(h_l)` through their group leader's projections). This is
the straightforward definition the engine's skipping forward is tested against, and the
differentiable forward distillation trains with (plain F.linear / SDPA, autograd intact).

`segment_ids` [B, S] (optional) packs several samples into one row: attention stays within
a segment and positions restart at each segment start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.models.causal_lm import CausalLM
from kvforge.models.gemma3 import Gemma3ForCausalLM
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.swiftkv import SwiftKVForCausalLM
from kvforge.rope import PositionedRope


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its segment, [B, S]."""
    batch, length = segment_ids.shape
    index = torch.arange(length, device=segment_ids.device).expand(batch, length)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def _attention_mask(segment_ids: torch.Tensor | None, batch: int, length: int, device: torch.device,
                    window: int | None) -> torch.Tensor:
    """[B, 1, S, S] bool: causal, within the segment, and within the sliding window."""
    index = torch.arange(length, device=device)
    delta = index[:, None] - index[None, :]
    causal = delta >= 0
    if window is not None:
        causal &= delta < window
    if segment_ids is None:
        return causal.expand(batch, 1, length, length)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, S, KVH, D] -> [B, S, H * D]."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).flatten(2)


def _check_model(model: CausalLM) -> None:
    if not isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM)):
        raise TypeError(f"dense forward supports Llama-family and Gemma3 models, not {type(model).__name__}")


@dataclass(frozen=True)
class DenseInputs:
    """What every layer of a dense forward shares: shape, masks per sliding window and the
    RoPE tables of each rotary kind. One object serves the teacher and the student of a
    distillation batch (same tokens, same positions)."""

    batch: int
    length: int
    masks: dict[int | None, torch.Tensor]
    ropes: list[PositionedRope]


def dense_inputs(model: CausalLM, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> DenseInputs:
    _check_model(model)
    config = model.config
    batch, length = token_ids.shape
    positions = segment_positions(segment_ids) if segment_ids is not None else \
        torch.arange(length, device=token_ids.device).expand(batch, length)
    masks = {window: _attention_mask(segment_ids, batch, length, token_ids.device, window)
             for window in {config.window_of(i) for i in range(config.num_layers)}}
    flat_positions = positions.reshape(-1)
    return DenseInputs(batch, length, masks, [rotary.at(flat_positions, dtype) for rotary in model.rotaries])


LaterKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


def _project(linear: torch.nn.Linear, x: torch.Tensor, n_heads: int, dim: int) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias).view(-1, n_heads, dim)


def swiftkv_later_kv(model: SwiftKVForCausalLM, inputs: DenseInputs, hidden: torch.Tensor) -> LaterKV:
    """K (normed when the model has QK-norm, rotated) and V of every later layer's cache
    from `hidden`, the input of layer l: `norm_swiftkv` then each group leader's
    k/v_proj_swiftkv and k_norm, the leader's RoPE; keyed by cache layer."""
    config, swift = model.config, model.config.swiftkv
    kv_input = model.model.norm_swiftkv(hidden)
    later_kv: LaterKV = {}
    for leader in swift.leaders(config.num_layers):
        attn = model.model.layers[leader].self_attn
        rope = inputs.ropes[model.rope_index[leader]]  # the group's kind: local or global RoPE
        k = _project(attn.k_proj_swiftkv, kv_input, config.num_kv_heads, config.head_dim)
        k = rope.apply(attn.k_norm(k) if attn.k_norm is not None else k)
        v = _project(attn.v_proj_swiftkv, kv_input, config.num_kv_heads, config.head_dim)
        later_kv[swift.cache_layer_of(leader)] = (k, v)
    return later_kv


def dense_layer(model: CausalLM, index: int, inputs: DenseInputs, hidden: torch.Tensor,
                later_kv: LaterKV | None = None) -> torch.Tensor:
    """Layer `index` on `hidden` (its input); a SwiftKV later layer takes its K/V from
    `later_kv` (see `swiftkv_later_kv`). Returns the layer's output."""
    config = model.config
    batch, length = inputs.batch, inputs.length
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    swift = config.swiftkv if isinstance(model, SwiftKVForCausalLM) else None
    layer = model.model.layers[index]
    rope = inputs.ropes[model.rope_index[index]]
    x = layer.input_layernorm(hidden)
    attn = layer.self_attn
    if swift is not None and swift.is_later(index):
        q = _project(attn.q_proj_swiftkv, x, heads, dim)
        k, v = later_kv[swift.cache_layer_of(index)]
    else:
        q, k, v = _project(attn.q_proj, x, heads, dim), _project(attn.k_proj, x, kv_heads, dim), \
            _project(attn.v_proj, x, kv_heads, dim)
        k = rope.apply(attn.k_norm(k) if attn.k_norm is not None else k)
    if attn.q_norm is not None:  # Gemma3's QK-norm, before RoPE
        q = attn.q_norm(q)
    q = rope.apply(q)
    shape = (batch, length)
    out = _attend(q.view(*shape, heads, dim), k.view(*shape, kv_heads, dim), v.view(*shape, kv_heads, dim),
                  inputs.masks[config.window_of(index)], config.attention_scale)
    out = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
    if config.architecture == "gemma3":  # sandwich norms: after attention and around the MLP
        hidden = hidden + layer.post_attention_layernorm(out)
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    hidden = hidden + out
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def dense_layers(model: CausalLM, inputs: DenseInputs, hidden: torch.Tensor, start: int, stop: int,
                 capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run layers [start, stop) on `hidden` (the input of layer `start`); returns the input
    of layer `stop` and the inputs of the layers listed in `capture` (index `stop` allowed).

    A SwiftKV model computes its later layers' K/V when it reaches layer l, so a range that
    contains later layers must start at or before l."""
    swift = model.config.swiftkv if isinstance(model, SwiftKVForCausalLM) else None
    if swift is not None and start > swift.num_key_value_layers and start < stop:
        raise ValueError(f"a SwiftKV dense range must start at or before layer l={swift.num_key_value_layers}")
    later_kv: LaterKV = {}
    captured: dict[int, torch.Tensor] = {}
    for index in range(start, stop):
        if index in capture:
            captured[index] = hidden
        if swift is not None and index == swift.num_key_value_layers:
            later_kv = swiftkv_later_kv(model, inputs, hidden)
        hidden = dense_layer(model, index, inputs, hidden, later_kv)
    if stop in capture:
        captured[stop] = hidden
    return hidden, captured


def dense_hidden_states(model: CausalLM, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                        output_layer: int | None = None) -> torch.Tensor:
    """Final hidden states [B, S, hidden] (before the final norm), or the input of layer
    `output_layer` when given (for hidden-state losses)."""
    _check_model(model)
    hidden = model.embed(token_ids)
    inputs = dense_inputs(model, token_ids, segment_ids, hidden.dtype)
    stop = model.config.num_layers if output_layer is None else output_layer
    return dense_layers(model, inputs, hidden, 0, stop)[0]


def dense_logits(model: CausalLM, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, S, vocab] of every token."""
    hidden = dense_hidden_states(model, token_ids, segment_ids)
    logits = F.linear(model.model.norm(hidden), model.lm_head.weight, model.lm_head.bias)
    cap = model.config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits
