"""The `full` method's decode-only steps in fixed shapes (cache/static_decode.py): per layer
group, the write slots, the page tables padded to `width` pages, and the visible ranges,
all fixed buffers; the plan's row order is the identity (every row a sequence, in order).

Padding rows write to the scratch page (one page per group held by `SCRATCH_SEQ`, taken
from the pool when the first bucket is made) and see nothing stored: visible_from ==
visible_to == 0, so each attends only to its own token. Padding table entries are page 0,
masked by position like the padding of any ragged batch (plan.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvforge.batch import ForwardBatch
from kvforge.cache.full.plan import DecodePlan, FullStepMetadata, GroupPlan, locate_rows, plan_group
from kvforge.cache.page_table import PageTable
from kvforge.cache.static_decode import SCRATCH_SEQ, StaticDecode
from kvforge.errors import CacheCapacityError

_RANGES = ("first_page_position", "visible_from", "visible_to")


class FullStaticDecode(StaticDecode[FullStepMetadata]):
    def __init__(self, pages: PageTable, check_batch: Callable[[ForwardBatch], None], device: torch.device,
                 rows: int, width: int) -> None:
        """`pages`: the cache's page tables; `check_batch`: its `begin_step` check."""
        if not pages.has(SCRATCH_SEQ) and not pages.allocate(SCRATCH_SEQ, 1):
            raise CacheCapacityError("no free page for the static decode step's scratch page")
        self.pages, self.check_batch, self.device, self.width = pages, check_batch, device, width
        groups = pages.groups.num_groups
        self.scratch_slots = [pages.require_slots(SCRATCH_SEQ, g, 0, 1)[0] * pages.block_size for g in range(groups)]
        shapes: dict[str, tuple[int, ...]] = {}
        for g in range(groups):
            shapes[f"{g}.write_slots"] = (rows,)
            shapes[f"{g}.page_table"] = (rows, width)
            shapes.update({f"{g}.{name}": (rows,) for name in _RANGES})
        super().__init__(rows, shapes, device)
        self.row_order = torch.arange(rows, device=device)
        # Until the first step loads, every row is padding (a capture runs on these values).
        self.buffers.fill({name: (torch.full(shape, self.scratch_slots[int(name.split(".")[0])])
                                  if name.endswith(".write_slots") else torch.zeros(shape, dtype=torch.long))
                           for name, shape in shapes.items()}
                          | {"token_ids": torch.zeros(rows, dtype=torch.long),
                             "positions": torch.zeros(rows, dtype=torch.long)})

    def make_meta(self) -> FullStepMetadata:
        buffers = self.buffers.tensors
        block = self.pages.block_size
        groups = []
        for g in range(len(self.scratch_slots)):
            decode = DecodePlan(
                seq_ids=tuple(span.seq_id for span in self.batch.spans), rows=self.row_order,
                page_table=buffers[f"{g}.page_table"],
                **{name: buffers[f"{g}.{name}"] for name in _RANGES},
                every_row=True, compact_tables=True, slots=self.width * block)
            groups.append(GroupPlan(write_rows=None, write_slots=buffers[f"{g}.write_slots"], decode=decode,
                                    prefills=()))
        meta = FullStepMetadata(self.batch, groups)
        # attend_rows (SwiftKV's later layers) asks for every row: located here, outside any
        # capture, since locating copies a small plan to the device.
        rows = self.batch.logit_rows
        meta.row_queries = (rows, locate_rows(meta, rows, self.device))
        return meta

    def plan(self, batch: ForwardBatch) -> tuple[FullStepMetadata, dict[str, torch.Tensor]] | None:
        self.check_batch(batch)
        pad = self.rows - len(batch.spans)
        host_groups = [plan_group(self.pages, g, batch) for g in range(len(self.scratch_slots))]
        values: dict[str, torch.Tensor] = {}
        for g, group in enumerate(host_groups):
            decode = group.decode
            if group.write_rows is not None or decode is None or decode.page_table.shape[1] > self.width:
                return None
            values[f"{g}.write_slots"] = F.pad(group.write_slots, (0, pad), value=self.scratch_slots[g])
            table = decode.page_table
            values[f"{g}.page_table"] = F.pad(table, (0, self.width - table.shape[1], 0, pad))
            values.update({f"{g}.{name}": F.pad(getattr(decode, name), (0, pad)) for name in _RANGES})
        return FullStepMetadata(batch, host_groups), values
