"""Building the per-step metadata of the `kivi` cache method (plan.py holds its types):
what each layer group flushes from the residuals into pages, the decode and prefill plans,
and the rows that stay in the residual rings or the sink buffers. Runs on the host once per
step (`KiviPlanner.on_host`); the cache sends it to the device in one copy (step_plan.upload).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.kivi.config import KIVICacheConfig
from kvforge.cache.kivi.memory import quantized_keys, quantized_values
from kvforge.cache.kivi.plan import (
    Decode,
    Flush,
    GroupPlan,
    Prefill,
    ResidualWrites,
    SequenceState,
)
from kvforge.cache.page_table import RELEASED, PageTable


@dataclass(frozen=True)
class KiviPlanner:
    """Reads the cache's page tables and sequence table (shared, not copied)."""

    config: KIVICacheConfig
    pages: PageTable
    seqs: dict[int, SequenceState]

    def on_host(self, batch: ForwardBatch) -> tuple[list[GroupPlan], ResidualWrites]:
        """The step's plan as host tensors: every layer group's, and the residual writes."""
        return [self.group(g, batch) for g in range(self.pages.groups.num_groups)], self.residual_writes(batch)

    def _keys(self, num_tokens: int) -> int:
        return quantized_keys(num_tokens, self.config.residual)

    def _values(self, num_tokens: int) -> int:
        return quantized_values(num_tokens, self.config.residual)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """A plan tensor on the host (begin_step uploads the whole plan at once)."""
        return torch.tensor(values, dtype=torch.long)

    def residual_writes(self, batch: ForwardBatch) -> ResidualWrites:
        r = self.config.residual
        key: tuple[list[int], list[int], list[int]] = ([], [], [])
        value: tuple[list[int], list[int], list[int]] = ([], [], [])
        sink: tuple[list[int], list[int], list[int]] = ([], [], [])
        for span in batch.spans:
            slot, n, end = self.seqs[span.seq_id].slot, span.cached_len, span.total_len
            for lists, first in ((key, self._keys(end)), (value, self._values(end))):
                for t in range(max(n, first), end):
                    lists[0].append(span.query_start + t - n)
                    lists[1].append(slot)
                    lists[2].append(t % r)
            for t in range(n, min(end, self.config.sinks)):
                sink[0].append(span.query_start + t - n)
                sink[1].append(slot)
                sink[2].append(t)
        as_tensors = lambda lists: tuple(self._tensor(x) for x in lists)  # noqa: E731
        every_row = list(range(batch.num_tokens))
        return ResidualWrites(as_tensors(key), as_tensors(value), as_tensors(sink),
                              key_rows_all=key[0] == every_row, value_rows_all=value[0] == every_row)

    def _kept_page(self, seq_id: int, group: int, logical: int) -> int:
        """Page id of a logical page, or RELEASED if the window dropped (or skipped) it."""
        table = self.pages.pages(seq_id, group)
        return table[logical] if logical < len(table) else RELEASED

    def group(self, group: int, batch: ForwardBatch) -> GroupPlan:
        g, r, sinks = self.config.key_tokens, self.config.residual, self.config.sinks
        key_sources: list[tuple[int, int, int, int]] = []  # (token order, kind, a, b)
        key_pages: list[int] = []
        fill_to: list[int] = []
        fill_from: list[int] = []
        value_sources: list[tuple[int, int, int, int]] = []
        value_slots: list[int] = []
        decode_spans: list[SequenceSpan] = []
        prefills: list[Prefill] = []
        for span in batch.spans:
            seq = self.seqs[span.seq_id]
            n, end = span.cached_len, span.total_len

            def source(t: int, slot: int = seq.slot, n: int = n, first_row: int = span.query_start
                       ) -> tuple[int, int, int]:
                # (0, slot, offset): still in the residual; (1, row, 0): a row of this step
                return (0, slot, t % r) if t < n else (1, first_row + t - n, 0)

            for logical in range(self._keys(n) // g, self._keys(end) // g):
                page = self._kept_page(span.seq_id, group, logical)
                if page == RELEASED:
                    continue  # outside the window of this group: never read again
                key_pages.append(page)
                first = len(key_sources)
                if logical * g < sinks < (logical + 1) * g:  # the page mixes sinks and later tokens
                    fill_to.extend(range(first, first + sinks - logical * g))
                    fill_from.extend([first + sinks - logical * g] * (sinks - logical * g))
                for t in range(logical * g, (logical + 1) * g):
                    key_sources.append((len(key_sources), *source(t)))
            for t in range(self._values(n), self._values(end)):
                page = self._kept_page(span.seq_id, group, t // g)
                if page == RELEASED:
                    continue
                value_slots.append(page * g + t % g)
                value_sources.append((len(value_sources), *source(t)))
            if span.query_len == 1:
                decode_spans.append(span)
            else:
                past_from, pages, first = self._past_pages(span, group)
                prefills.append(Prefill(span, self._tensor(pages), first, past_from, seq.slot))
        key_res, key_rows, key_order = self._sources(key_sources)
        value_res, value_rows, value_order = self._sources(value_sources)
        flush = Flush(key_res, key_rows, key_order, self._tensor(key_pages),
                       (self._tensor(fill_to), self._tensor(fill_from)), value_res, value_rows, value_order, self._tensor(value_slots))
        return GroupPlan(flush, self._plan_decode(group, decode_spans) if decode_spans else None,
                          tuple(prefills))

    def _sources(self, sources: list[tuple[int, int, int, int]]
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Split token sources into residual reads and row reads; the permutation that
        restores token order after concatenating [residual reads, row reads]."""
        from_res = [s for s in sources if s[1] == 0]
        from_rows = [s for s in sources if s[1] == 1]
        order = [0] * len(sources)
        for position, s in enumerate(from_res + from_rows):
            order[s[0]] = position
        return ((self._tensor([s[2] for s in from_res]), self._tensor([s[3] for s in from_res])),
                self._tensor([s[2] for s in from_rows]), self._tensor(order))

    def _past_pages(self, span: SequenceSpan, group: int) -> tuple[int, list[int], int]:
        """(first visible past token, pages of quantised keys from it, position of the first page)."""
        g = self.config.key_tokens
        past_from = self.pages.first_kept_token(group, span.cached_len)
        nk = self._keys(span.cached_len)
        pages = self.pages.require_slots(span.seq_id, group, past_from, nk) if nk > past_from else []
        return past_from, pages, (past_from // g) * g

    def _plan_decode(self, group: int, spans: list[SequenceSpan]) -> Decode:
        tables: list[list[int]] = []
        firsts: list[int] = []
        visible: list[int] = []
        for span in spans:
            past_from, pages, first = self._past_pages(span, group)
            tables.append(pages)
            firsts.append(first)
            visible.append(past_from)
        width = max(1, max(len(t) for t in tables))
        padded = [t + [0] * (width - len(t)) for t in tables]  # padding is masked by position
        starts = [s.query_start for s in spans]
        return Decode(
            rows=self._tensor(starts),
            page_table=self._tensor(padded).reshape(len(spans), width),
            first_page_position=self._tensor(firsts),
            visible_from=self._tensor(visible),
            lengths=self._tensor([s.cached_len for s in spans]),
            slots=self._tensor([self.seqs[s.seq_id].slot for s in spans]),
            rows_in_order=starts == list(range(len(spans))),
        )
