"""The per-step metadata of the `full` cache method (method.py): built once per step on the
host from the batch and the page tables, uploaded to the compute device in one copy
(step_plan.upload), and read by every layer of the step, by the fused decode op and by
CUDA-graph replay alike.

Per layer group: the flat slots the step's rows are stored at, the decode sequences' page
tables and visible ranges, and each prefill chunk's visible past.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.attention import hidden_slots
from kvforge.cache.base import StepMetadata
from kvforge.cache.page_table import PageTable
from kvforge.step_plan import upload


@dataclass(frozen=True)
class DecodePlan:
    seq_ids: tuple[int, ...]
    rows: torch.Tensor  # [B] rows of the batch with a single new token
    page_table: torch.Tensor  # [B, P]
    first_page_position: torch.Tensor  # [B]
    visible_from: torch.Tensor  # [B]
    visible_to: torch.Tensor  # [B] == cached_len
    # True when the step is decode only and `rows` is 0..B-1: q, k and v then need no
    # gather and the kernel's output is the layer's output (no scatter).
    every_row: bool
    # Host-side: the batch's tables padded to the widest hold at most twice the real pages
    # (plus one per sequence), so a gather of the padded table stays proportional to the cache.
    compact_tables: bool
    slots: int  # page_table's width in token slots (pages x block size)

    @functools.cached_property
    def hidden(self) -> torch.Tensor:
        """The gathered path's mask, `hidden_slots` [B, slots]: made on first use, so once per
        step for all of the group's layers (plans are rebuilt every step)."""
        return hidden_slots(self.first_page_position, self.visible_from, self.visible_to, self.slots)


@dataclass(frozen=True)
class PrefillPlan:
    span: SequenceSpan
    pages: torch.Tensor  # pages holding the visible past, in order
    past_from: int  # first visible past position
    first_page_position: int


@dataclass(frozen=True)
class GroupPlan:
    write_rows: torch.Tensor | None  # rows stored in this group (None: all rows)
    write_slots: torch.Tensor  # flat slot (page * block + offset) per stored row
    decode: DecodePlan | None
    prefills: tuple[PrefillPlan, ...]


@dataclass(frozen=True)
class RowQueries:
    """attend_rows of a step: where each sequence's queries are among the requested rows,
    and for the decode plan's sequences the row each reads and writes, and whether it has one."""
    queries: dict[int, tuple[int, int]]  # seq -> (first row in q, count)
    read: torch.Tensor  # [B]
    write: torch.Tensor  # [B] (rows requested: the spare row past them)
    keep: torch.Tensor  # [B, 1, 1] bool


@dataclass
class FullStepMetadata(StepMetadata):
    groups: list[GroupPlan]  # one per layer group, on the compute device
    # The step's post-RoPE K and V per cache layer, as `write` hands them to `attend`.
    step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # attend_rows: the rows asked for, and where each sequence's queries are among them
    # (None: not trailing runs per span), located once for every later layer
    row_queries: tuple[torch.Tensor, RowQueries | None] | None = None


def plan_step(pages: PageTable, batch: ForwardBatch, device: torch.device) -> FullStepMetadata:
    """Planned on the host, then one copy to the device: no transfer inside the layer loop."""
    groups = upload([plan_group(pages, group, batch) for group in range(pages.groups.num_groups)], device)
    return FullStepMetadata(batch, groups)


def plan_group(pages: PageTable, group: int, batch: ForwardBatch) -> GroupPlan:
    """Per-step metadata of one layer group, shared by every layer in it."""
    block = pages.block_size
    rows: list[int] = []
    slots: list[int] = []
    decode_spans: list[SequenceSpan] = []
    prefills: list[PrefillPlan] = []
    for span in batch.spans:
        stored_from = max(span.cached_len, pages.first_kept_token(group, span.total_len))
        table = pages.require_slots(span.seq_id, group, stored_from, span.total_len)
        first_page = stored_from // block
        for position in range(stored_from, span.total_len):
            rows.append(span.query_start + position - span.cached_len)
            slots.append(table[position // block - first_page] * block + position % block)
        if span.query_len == 1:
            decode_spans.append(span)
        else:
            past_from = pages.first_kept_token(group, span.cached_len)
            past = pages.require_slots(span.seq_id, group, past_from, span.cached_len)
            prefills.append(PrefillPlan(span, torch.tensor(past, dtype=torch.long), past_from,
                                        (past_from // block) * block))
    write_rows = None if len(rows) == batch.num_tokens else torch.tensor(rows, dtype=torch.long)
    every_row = (not prefills and len(decode_spans) == batch.num_tokens
                 and all(s.query_start == i for i, s in enumerate(decode_spans)))
    return GroupPlan(
        write_rows=write_rows,
        write_slots=torch.tensor(slots, dtype=torch.long),
        decode=plan_decode(pages, group, decode_spans, every_row) if decode_spans else None,
        prefills=tuple(prefills),
    )


def plan_decode(pages: PageTable, group: int, spans: list[SequenceSpan], every_row: bool) -> DecodePlan:
    block = pages.block_size
    tables: list[list[int]] = []
    first_positions: list[int] = []
    visible_from: list[int] = []
    for span in spans:
        start = pages.first_kept_token(group, span.cached_len)
        tables.append(pages.require_slots(span.seq_id, group, start, span.cached_len))
        first_positions.append((start // block) * block)
        visible_from.append(start)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]  # padding is masked by position
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731 (host: see upload)
    return DecodePlan(
        seq_ids=tuple(s.seq_id for s in spans),
        rows=as_tensor([s.query_start for s in spans]),
        page_table=as_tensor(padded).reshape(len(spans), width),
        first_page_position=as_tensor(first_positions),
        visible_from=as_tensor(visible_from),
        visible_to=as_tensor([s.cached_len for s in spans]),
        every_row=every_row,
        compact_tables=width * len(tables) <= 2 * sum(len(t) for t in tables) + len(tables),
        slots=width * block,
    )


def locate_rows(meta: FullStepMetadata, rows: torch.Tensor, device: torch.device) -> RowQueries | None:
    """Where attend_rows' `rows` put each sequence's queries, when they are trailing rows of
    each span (as SwiftKV's logit rows are); None otherwise."""
    batch = meta.batch
    counts = batch.trailing_counts(rows)
    if counts is None:
        return None
    queries: dict[int, tuple[int, int]] = {}
    offset = 0
    for span, count in zip(batch.spans, counts):
        queries[span.seq_id] = (offset, count)
        offset += count
    decode = meta.groups[0].decode if meta.groups else None
    located = [queries[seq] for seq in decode.seq_ids] if decode is not None else []
    # A one-token span without a requested row reads row 0 (zeroed by `keep`) and
    # writes the spare row past the rows requested.
    read = torch.tensor([first if count else 0 for first, count in located], dtype=torch.long)
    write = torch.tensor([first if count else offset for first, count in located], dtype=torch.long)
    read, write = upload((read, write), device)
    return RowQueries(queries, read, write, (write < offset)[:, None, None])
