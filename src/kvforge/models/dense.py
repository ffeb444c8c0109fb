"""Dense, cache-free forward of any kvforge decoder, SwiftKV or not, over whole sequences.

Every token runs every layer (for a SwiftKV model: with the SwiftKV wiring, i.e. later
layers take K/V from `norm_swiftkv(h_l)` through their group leader's projections). This is
the straightforward definition the engine's skipping forward is tested against, and the
differentiable forward distillation trains with. It runs the model's own layer modules
(so a family is defined once), over `DenseCache`: a cache method that keeps nothing
between calls and attends every row over its whole sequence with plain SDPA and a mask
(autograd intact).

`segment_ids` [B, S] (optional) packs several samples into one row: attention stays within
a segment and positions restart at each segment start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.cache.layout import CacheLayout
from kvforge.models.causal_lm import CausalLM
from kvforge.models.swiftkv import SwiftKVForCausalLM
from kvforge.rope import PositionedRope

LaterKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # cache layer -> (post-RoPE K, V) [B * S, kv_heads, D]


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


@dataclass(frozen=True)
class DenseInputs:
    """What every layer of a dense forward shares: the flattened batch (B rows of S tokens),
    masks per sliding window and the RoPE tables of each rotary kind. One object serves the
    teacher and the student of a distillation batch (same tokens, same positions)."""

    batch: int
    length: int
    masks: dict[int | None, torch.Tensor]
    ropes: list[PositionedRope]
    flat: ForwardBatch


def dense_inputs(model: CausalLM, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> DenseInputs:
    config = model.config
    batch, length = token_ids.shape
    positions = segment_positions(segment_ids) if segment_ids is not None else \
        torch.arange(length, device=token_ids.device).expand(batch, length)
    masks = {window: _attention_mask(segment_ids, batch, length, token_ids.device, window)
             for window in {config.window_of(i) for i in range(config.num_layers)}}
    flat_positions = positions.reshape(-1)
    rows = batch * length
    spans = tuple(SequenceSpan(b, b * length, length, 0) for b in range(batch))
    every_row = torch.arange(rows, device=token_ids.device)
    flat = ForwardBatch(token_ids=token_ids.reshape(-1), positions=flat_positions, spans=spans,
                        logit_rows=every_row, logit_row_list=tuple(range(rows)))
    return DenseInputs(batch, length, masks, [rotary.at(flat_positions, dtype) for rotary in model.rotaries], flat)


@dataclass
class DenseStep(StepMetadata):
    inputs: DenseInputs
    kv: LaterKV = field(default_factory=dict)  # what `write` stored: post-RoPE K and V per cache layer


class DenseCache(CacheMethod[DenseStep]):
    """A cache method for `DenseInputs`: `write` keeps the layer's post-RoPE K/V for the call,
    `attend` is masked SDPA over every row's whole sequence. Holds no sequence."""

    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(layout, torch.float32, torch.device("cpu"))

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        return True

    def free(self, seq_id: int) -> None:
        return None

    def num_cached_tokens(self, seq_id: int) -> int:
        return 0

    def memory_usage(self) -> dict[str, int]:
        return {"fast": 0, "slow": 0}

    def begin_step(self, batch: ForwardBatch) -> DenseStep:
        raise NotImplementedError("a dense forward builds its steps from DenseInputs (dense_layer)")

    def end_step(self, meta: DenseStep) -> None:
        return None

    def write(self, cache_layer: int, meta: DenseStep, k_pre: torch.Tensor, v: torch.Tensor,
              rope: PositionedRope) -> None:
        meta.kv[cache_layer] = (rope.apply(k_pre), v)

    def attend(self, cache_layer: int, meta: DenseStep, q: torch.Tensor, rope: PositionedRope) -> torch.Tensor:
        spec = self.layout.specs[cache_layer]
        k, v = meta.kv[cache_layer]
        shape = (meta.inputs.batch, meta.inputs.length)
        out = _attend(q.view(*shape, *q.shape[1:]), k.view(*shape, *k.shape[1:]), v.view(*shape, *v.shape[1:]),
                      meta.inputs.masks[spec.sliding_window], spec.scale)
        return out.view(q.shape)

    def attend_rows(self, cache_layer: int, meta: DenseStep, q: torch.Tensor, rope: PositionedRope,
                    rows: torch.Tensor) -> torch.Tensor:
        # Every row of a dense forward needs logits: SwiftKV's later layers ask for all of them.
        assert rows.shape[0] == meta.batch.num_tokens, "a dense forward attends every row"
        return self.attend(cache_layer, meta, q, rope)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, S, KVH, D] -> [B, S, H, D]."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(1, 2)


def _step(model: CausalLM, inputs: DenseInputs, later_kv: LaterKV | None) -> tuple[DenseCache, DenseStep]:
    """A fresh cache and step for one call: the teacher's and the student's layers of a
    distillation batch never see each other's K/V."""
    return DenseCache(model.cache_layout()), DenseStep(inputs.flat, inputs, dict(later_kv or {}))


def swiftkv_later_kv(model: SwiftKVForCausalLM, inputs: DenseInputs, hidden: torch.Tensor) -> LaterKV:
    """K (normed when the model has QK-norm, rotated) and V of every later layer's cache from
    `hidden` [B, S, hidden] or [B * S, hidden], the input of layer l, keyed by cache layer: what
    the model's own SingleInputKV write stores."""
    cache, step = _step(model, inputs, None)
    model._write_later_kv(hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1]), cache, step,
                          inputs.ropes)
    return step.kv


def dense_layer(model: CausalLM, index: int, inputs: DenseInputs, hidden: torch.Tensor,
                later_kv: LaterKV | None = None) -> torch.Tensor:
    """The model's layer `index` on `hidden` [B, S, hidden] or [B * S, hidden] (its input); a
    SwiftKV later layer takes its K/V from `later_kv` (see `swiftkv_later_kv`). Returns the
    layer's output, shaped as `hidden`."""
    cache, step = _step(model, inputs, later_kv)
    layer = model.model.layers[index]
    rope = inputs.ropes[model.rope_index[index]]
    flat = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    swift = model.config.swiftkv if isinstance(model, SwiftKVForCausalLM) else None
    if swift is not None and swift.is_later(index):
        out = layer(flat, cache, step, rope, rope, inputs.flat.logit_rows)
    else:
        out = layer(flat, cache, step, rope)
    # A flat input keeps a flat, non-view output (FSDP warns about module outputs that are views).
    return out if hidden.dim() == 2 else out.view(hidden.shape)


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
            later_kv = swiftkv_later_kv(model, inputs, hidden)  # type: ignore[arg-type]
        hidden = dense_layer(model, index, inputs, hidden, later_kv)
    if stop in capture:
        captured[stop] = hidden
    return hidden, captured


def dense_hidden_states(model: CausalLM, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None,
                        output_layer: int | None = None) -> torch.Tensor:
    """Final hidden states [B, S, hidden] (before the final norm), or the input of layer
    `output_layer` when given (for hidden-state losses)."""
    hidden = model.embed(token_ids)
    inputs = dense_inputs(model, token_ids, segment_ids, hidden.dtype)
    stop = model.config.num_layers if output_layer is None else output_layer
    return dense_layers(model, inputs, hidden, 0, stop)[0]


def dense_logits(model: CausalLM, token_ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, S, vocab] of every token (the model's final norm, head and soft-capping)."""
    hidden = dense_hidden_states(model, token_ids, segment_ids)
    return model.logits(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1)
