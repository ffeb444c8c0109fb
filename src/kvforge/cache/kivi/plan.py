"""The per-step plan of the `kivi` cache method (method.py): what each layer group flushes
from the residuals into pages, which sequences decode or prefill, and which rows stay in
the residual rings or the sink buffers. Built on the host in `begin_step`, uploaded to the
device once (step_plan.upload), read by every layer of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.batch import SequenceSpan
from kvforge.cache.base import StepMetadata


@dataclass
class SequenceState:
    slot: int  # residual slot
    num_tokens: int = 0


@dataclass(frozen=True)
class Flush:
    """Tokens of a step that leave the residuals, for one layer group. Sources are either
    residual offsets (slot, t % R) or rows of the step; `*_order` puts the concatenation
    [from residual, from rows] back in token order."""

    key_res: tuple[torch.Tensor, torch.Tensor]  # (slots, offsets) of keys read from k_res
    key_rows: torch.Tensor
    key_order: torch.Tensor
    key_pages: torch.Tensor  # destination page per G keys
    # (destinations, sources) in the flushed keys' order: sink tokens of a page that also
    # holds later tokens take a later token's key, so sinks do not set the page's ranges.
    key_fill: tuple[torch.Tensor, torch.Tensor]
    value_res: tuple[torch.Tensor, torch.Tensor]
    value_rows: torch.Tensor
    value_order: torch.Tensor
    value_slots: torch.Tensor  # destination page * G + offset per value


@dataclass(frozen=True)
class Decode:
    rows: torch.Tensor
    page_table: torch.Tensor
    first_page_position: torch.Tensor
    visible_from: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    # rows is 0, 1, ..., n - 1 (known on the host): with no prefill in the step, the step's
    # tensors are the decode rows as they are, and no row is gathered or scattered.
    rows_in_order: bool = False
    # residual_split's results by residual size: made once per step for every layer of the
    # group (plans are rebuilt every step, and a captured step records them once)
    _splits: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False, compare=False,
                                                                   repr=False)  # (a `replace` starts afresh)

    def residual_split(self, residual: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual_split(self.lengths, residual)`, made once per step."""
        if residual not in self._splits:
            self._splits[residual] = residual_split(self.lengths, residual)
        return self._splits[residual]


def residual_split(lengths: torch.Tensor, residual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nk, nv) per sequence of `lengths` tokens under the residual rules for rings of
    `residual` tokens: keys of tokens < nk are in the pages (flushed `residual` at a time),
    values of tokens < nv (all but the last `residual`)."""
    return (lengths // residual) * residual, (lengths - residual).clamp(min=0)


@dataclass(frozen=True)
class Prefill:
    span: SequenceSpan
    pages: torch.Tensor
    first_page_position: int
    past_from: int
    slot: int


@dataclass(frozen=True)
class GroupPlan:
    flush: Flush
    decode: Decode | None
    prefills: tuple[Prefill, ...]


@dataclass(frozen=True)
class ResidualWrites:
    """Step rows that stay in the residuals, written at end_step (same for every layer)."""

    key: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, slots, offsets)
    value: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    sink: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, slots, token index < sinks)
    # key/value rows are every row of the step in order (a decode step whose tokens all stay
    # in the residuals): the step's K/V are written as they are, not gathered first.
    key_rows_all: bool = False
    value_rows_all: bool = False


@dataclass
class KiviStepMetadata(StepMetadata):
    groups: list[GroupPlan]  # one per layer group
    residual_writes: ResidualWrites
    # Per cache layer of the step: (keys, values) as stored, from `write` (or the fused op);
    # and the attention keys where they differ from the stored ones (key_space=pre_rope:
    # post-RoPE, not rotated).
    step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    attention_keys: dict[int, torch.Tensor] = field(default_factory=dict)
