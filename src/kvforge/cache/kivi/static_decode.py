"""The `kivi` method's decode-only steps in fixed shapes (cache/static_decode.py).

KIVI changes no storage inside the layer loop: `write` keeps the step's K/V in the
metadata, `attend` reads the state before the step, and every store (tokens leaving the
residuals quantised into pages, the rows that stay in the rings) happens at `end_step`.
So the fixed-shape step holds only the attention plan of each layer group (padded page
tables of `width` key pages, first page positions, visible starts, lengths, residual
slots); its flush and residual writes are empty. The stores run eagerly after it: `finish`
hands the step's K/V of the real rows to the host metadata, whose `end_step` flushes and
writes exactly as the dynamic step would (their sizes vary from step to step, which a
captured graph cannot).

Padding rows have length 0: they see no page and no residual token (slot 0 is read and
masked), only their own token, and are never stored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvforge.batch import ForwardBatch
from kvforge.cache.kivi.plan import Decode, Flush, GroupPlan, KiviStepMetadata, ResidualWrites
from kvforge.cache.static_decode import StaticDecode
from kvforge.step_plan import upload

HostPlan = Callable[[ForwardBatch], tuple[list[GroupPlan], ResidualWrites]]

_PER_ROW = ("first_page_position", "visible_from", "lengths", "slots")


class KiviStaticDecode(StaticDecode[KiviStepMetadata]):
    def __init__(self, host_plan: HostPlan, num_groups: int, device: torch.device, rows: int, width: int) -> None:
        """`host_plan`: the cache's checks and plan of a step, as host tensors."""
        self.host_plan, self.num_groups, self.device, self.width = host_plan, num_groups, device, width
        shapes: dict[str, tuple[int, ...]] = {}
        for g in range(self.num_groups):
            shapes[f"{g}.page_table"] = (rows, width)
            shapes.update({f"{g}.{name}": (rows,) for name in _PER_ROW})
        super().__init__(rows, shapes, device)
        self.row_order = torch.arange(rows, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        self.no_flush = Flush((empty, empty), empty, empty, empty, (empty, empty), (empty, empty), empty, empty, empty)
        self.no_writes = ResidualWrites((empty,) * 3, (empty,) * 3, (empty,) * 3)

    def make_meta(self, form: str = "any") -> KiviStepMetadata:
        buffers = self.buffers.tensors
        groups = [GroupPlan(self.no_flush,
                            Decode(rows=self.row_order, page_table=buffers[f"{g}.page_table"],
                                   **{name: buffers[f"{g}.{name}"] for name in _PER_ROW}, rows_in_order=True),
                            ()) for g in range(self.num_groups)]
        return KiviStepMetadata(self.batch, groups, self.no_writes)

    def plan(self, batch: ForwardBatch) -> tuple[KiviStepMetadata, dict[str, torch.Tensor]] | None:
        groups, writes = self.host_plan(batch)
        pad = self.rows - len(batch.spans)
        values: dict[str, torch.Tensor] = {}
        for g, group in enumerate(groups):
            decode = group.decode
            if decode is None or group.prefills or not decode.rows_in_order or decode.page_table.shape[1] > self.width:
                return None
            table = decode.page_table
            values[f"{g}.page_table"] = F.pad(table, (0, self.width - table.shape[1], 0, pad))
            values.update({f"{g}.{name}": F.pad(getattr(decode, name), (0, pad)) for name in _PER_ROW})
        return KiviStepMetadata(batch, *upload((groups, writes), self.device)), values

    def finish(self, host_meta: KiviStepMetadata, meta: KiviStepMetadata, rows: int) -> None:
        host_meta.step_kv = {layer: (k[:rows], v[:rows]) for layer, (k, v) in meta.step_kv.items()}
        host_meta.attention_keys = {layer: k[:rows] for layer, k in meta.attention_keys.items()}
