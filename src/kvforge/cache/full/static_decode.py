"""The `full` method's decode-only steps in fixed shapes (cache/static_decode.py): per layer
group, the write slots, the page tables padded to `width` pages, and the visible ranges,
all fixed buffers; the plan's row order is the identity (every row a sequence, in order).

Padding rows write to the scratch page (one page per group held by `SCRATCH_SEQ`, set
aside before the first bucket is made and left out of the capacity admission checks:
`FullCache.set_aside_scratch_pages`) and see nothing stored: visible_from == visible_to ==
0, so each attends only to its own token. Padding table entries are page 0,
masked by position like the padding of any ragged batch (plan.py).

`FullStaticLayout` is those buffers alone, so a method that keeps inner `full` caches
(ShadowKV's exact and sliding-window stores) can hold them among its own buffers, under a
prefix, with its sequences at any rows and the other rows padding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from kvforge.batch import ForwardBatch
from kvforge.cache.full.plan import DecodePlan, FullStepMetadata, GroupPlan, locate_rows, plan_group
from kvforge.cache.page_table import PageTable
from kvforge.cache.static_decode import SCRATCH_SEQ, StaticDecode

_RANGES = ("first_page_position", "visible_from", "visible_to")


class FullStaticLayout:
    """The fixed buffers of a `full` cache's decode step over `rows` rows with tables at
    most `width` pages wide, named `prefix` + `{group}.{field}`."""

    def __init__(self, pages: PageTable, rows: int, width: int, prefix: str = "") -> None:
        if not pages.has(SCRATCH_SEQ):
            raise RuntimeError("the cache sets its scratch pages aside first (FullCache.set_aside_scratch_pages)")
        self.pages, self.width, self.prefix = pages, width, prefix
        groups = pages.groups.num_groups
        self.scratch_slots = [pages.require_slots(SCRATCH_SEQ, g, 0, 1)[0] * pages.block_size for g in range(groups)]
        self.shapes: dict[str, tuple[int, ...]] = {}
        for g in range(groups):
            self.shapes[self._name(g, "write_slots")] = (rows,)
            self.shapes[self._name(g, "page_table")] = (rows, width)
            self.shapes.update({self._name(g, name): (rows,) for name in _RANGES})

    def _name(self, group: int, field: str) -> str:
        return f"{self.prefix}{group}.{field}"

    def padding(self) -> dict[str, torch.Tensor]:
        """Every row padding: writes to the scratch page, sees nothing stored."""
        values = {name: torch.zeros(shape, dtype=torch.long) for name, shape in self.shapes.items()}
        for g, slot in enumerate(self.scratch_slots):
            values[self._name(g, "write_slots")].fill_(slot)
        return values

    def values(self, host_groups: list[GroupPlan], at: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        """The buffers' host values for a decode-only host plan (`plan_group` per group) whose
        sequences go to rows `at` (None: the first rows), padding elsewhere; None when the
        plan is not every row decoding or a table is wider than the buffers."""
        values = self.padding()
        for g, group in enumerate(host_groups):
            decode = group.decode
            if group.write_rows is not None or decode is None or decode.page_table.shape[1] > self.width:
                return None
            rows = at if at is not None else slice(0, decode.page_table.shape[0])
            values[self._name(g, "write_slots")][rows] = group.write_slots
            values[self._name(g, "page_table")][rows] = F.pad(decode.page_table,
                                                              (0, self.width - decode.page_table.shape[1]))
            for name in _RANGES:
                values[self._name(g, name)][rows] = getattr(decode, name)
        return values

    def meta(self, buffers: Mapping[str, torch.Tensor], batch: ForwardBatch, row_order: torch.Tensor,
             device: torch.device) -> FullStepMetadata:
        """Step metadata over the buffers for `batch` (the static step's padded batch)."""
        block = self.pages.block_size
        groups = []
        for g in range(len(self.scratch_slots)):
            decode = DecodePlan(
                seq_ids=tuple(span.seq_id for span in batch.spans), rows=row_order,
                page_table=buffers[self._name(g, "page_table")],
                **{name: buffers[self._name(g, name)] for name in _RANGES},
                every_row=True, compact_tables=True, slots=self.width * block)
            groups.append(GroupPlan(write_rows=None, write_slots=buffers[self._name(g, "write_slots")],
                                    decode=decode, prefills=()))
        meta = FullStepMetadata(batch, groups)
        # attend_rows (SwiftKV's later layers) asks for every row: located here, outside any
        # capture, since locating copies a small plan to the device.
        rows = batch.logit_rows
        meta.row_queries = (rows, locate_rows(meta, rows, device))
        return meta


class FullStaticDecode(StaticDecode[FullStepMetadata]):
    def __init__(self, pages: PageTable, check_batch: Callable[[ForwardBatch], None], device: torch.device,
                 rows: int, width: int) -> None:
        """`pages`: the cache's page tables; `check_batch`: its `begin_step` check."""
        self.layout = FullStaticLayout(pages, rows, width)
        self.pages, self.check_batch, self.device = pages, check_batch, device
        super().__init__(rows, self.layout.shapes, device)
        self.row_order = torch.arange(rows, device=device)
        # Until the first step loads, every row is padding (a capture runs on these values).
        self.buffers.fill(self.layout.padding() | {"token_ids": torch.zeros(rows, dtype=torch.long),
                                                   "positions": torch.zeros(rows, dtype=torch.long)})

    def make_meta(self, form: str = "any") -> FullStepMetadata:
        return self.layout.meta(self.buffers.tensors, self.batch, self.row_order, self.device)

    def plan(self, batch: ForwardBatch) -> tuple[FullStepMetadata, dict[str, torch.Tensor]] | None:
        self.check_batch(batch)
        host_groups = [plan_group(self.pages, g, batch) for g in range(len(self.layout.scratch_slots))]
        values = self.layout.values(host_groups, None)
        return (FullStepMetadata(batch, host_groups), values) if values is not None else None
