"""The queries `rank=attention` reads: the last rows of each prompt that compresses in a
step, kept per (cache layer, sequence) from the step's attention calls.

Only the step that compresses a sequence records, and only with `rank=attention`. Every
attention call on a global cache layer adds its rows of the compressing spans: a layer
whose cache is shared (SwiftKV's AcrossKV) gets the queries of every model layer reading
it, and SwiftKV's later layers, which attend only the logit rows, give one row each. At
most `limit` rows per model-layer call are kept (the latest positions).
"""

from __future__ import annotations

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.shadowkv.attention_rank import QuerySample

QUERY_ROWS = 16  # last prompt rows per attention call: enough for a stable error, cheap


class QuerySampler:
    def __init__(self, enabled: bool = True, limit: int = QUERY_ROWS) -> None:
        self.enabled = enabled  # False: record() keeps nothing (rules that read no queries)
        self.limit = limit
        self._kept: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(self, cache_layer: int, batch: ForwardBatch, spans: tuple[SequenceSpan, ...], q: torch.Tensor,
               rows: torch.Tensor | None = None) -> None:
        """q [R, heads, D] post-RoPE: batch rows 0..R-1, or the batch rows `rows` [R]."""
        if not spans or not self.enabled:
            return
        row_of_q = rows.tolist() if rows is not None else None  # a compressing step only (rare)
        for span in spans:
            if row_of_q is None:
                picked = list(range(max(span.query_start, span.query_end - self.limit), span.query_end))
                index = picked
            else:
                index = [i for i, r in enumerate(row_of_q) if span.query_start <= r < span.query_end][-self.limit:]
                picked = [row_of_q[i] for i in index]
            if not index:
                continue
            where = torch.tensor(index, dtype=torch.long, device=q.device)
            positions = batch.positions[torch.tensor(picked, dtype=torch.long, device=batch.positions.device)]
            self._kept.setdefault((cache_layer, span.seq_id), []).append((q[where].detach(), positions))

    def sample(self, cache_layer: int, seq_id: int) -> QuerySample | None:
        kept = self._kept.get((cache_layer, seq_id))
        if not kept:
            return None
        # Rows of different model layers sharing the cache layer are stacked as more queries.
        return QuerySample(torch.cat([q for q, _ in kept]), torch.cat([p for _, p in kept]))
