"""The per-step metadata of the `shadowkv` cache method (method.py): which sequences are
exact (attended by the inner `full` caches over a sub-batch of their rows, with its own
`FullStepMetadata`), which compress at the end of the step, which decode compressed (their
sparse groups), and what the step's layers leave for `end_step` (post-RoPE K/V of the
compressed sequences, each global layer's RoPE tables).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.base import StepMetadata
from kvforge.cache.full.plan import FullStepMetadata
from kvforge.cache.shadowkv.query_samples import QuerySampler
from kvforge.cache.shadowkv.sparse import SparseGroup
from kvforge.rope import PositionedRope
from kvforge.step_plan import upload


@dataclass
class ShadowKVStepMetadata(StepMetadata):
    # The inner caches' steps: the exact sequences (rows renumbered) and the sliding layers.
    exact: FullStepMetadata | None
    sliding: FullStepMetadata | None
    exact_rows: torch.Tensor | None  # the exact sequences' rows in the batch (None: every row)
    compressing: tuple[SequenceSpan, ...]
    compressed_spans: tuple[SequenceSpan, ...]
    groups: tuple[SparseGroup, ...]
    any_compressed: bool
    # rank=attention: the compressing prompts' last queries, from this step's attention calls
    queries: QuerySampler
    exact_ropes: dict[int, PositionedRope] = field(default_factory=dict)  # sub-ropes of exact rows
    # A fixed step (static_decode.py): its batch is one logit row per row of the bucket,
    # in order, every row exact or padding (no slots) or in its one sparse group.
    fixed: bool = False
    # A fixed step of form "any": 1 where the row's sequence is exact. Both attentions then
    # run over every row and each row keeps its own (None: a dynamic step, or a fixed step
    # whose rows are all compressed or padding).
    mixed_rows: torch.Tensor | None = None
    keep_exact: torch.Tensor | None = None  # mixed_rows != 0, made at the first global layer for the others
    # attend_rows of a mixed step: the rows asked for and where they go (None: generic path),
    # located once for every later layer
    row_split: tuple[torch.Tensor, RowSplit | None] | None = None
    # The compressed sequences' post-RoPE K and V of the step, per global cache layer.
    step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The step's RoPE per global layer (inner index), for compressing and folding at end_step.
    layer_ropes: dict[int, PositionedRope] = field(default_factory=dict)

    @property
    def exact_batch(self) -> ForwardBatch | None:
        """The batch of the exact sequences (rows renumbered); None when there is none."""
        return self.exact.batch if self.exact is not None else None


@dataclass(frozen=True)
class RowSplit:
    """Rows asked of attend_rows in a step that mixes exact and compressed sequences: the
    exact ones go to the inner cache's attend_rows (only those rows attend), the compressed
    ones to their sparse groups."""

    exact_q: torch.Tensor  # positions in q of rows of exact sequences
    exact_rows: torch.Tensor  # the same rows in the exact sub-batch (one tensor for every layer)
    compressed_q: torch.Tensor  # positions in q of rows of compressed sequences
    compressed_rows: torch.Tensor  # the same rows in the batch


def exact_sub_batch(batch: ForwardBatch, spans: list[SequenceSpan]
                    ) -> tuple[ForwardBatch | None, torch.Tensor | None]:
    """The batch restricted to exact sequences, rows renumbered; (batch, None) if all are."""
    if len(spans) == len(batch.spans):
        return batch, None
    if not spans:
        return None, None
    rows: list[int] = []
    renumbered: list[SequenceSpan] = []
    for span in spans:
        renumbered.append(SequenceSpan(span.seq_id, len(rows), span.query_len, span.cached_len))
        rows.extend(range(span.query_start, span.query_end))
    index = upload(torch.tensor(rows, dtype=torch.long), batch.token_ids.device)
    sub = ForwardBatch(token_ids=batch.token_ids[index], positions=batch.positions[index],
                       spans=tuple(renumbered), logit_rows=index.new_empty(0), logit_row_list=())
    return sub, index


def exact_rope(meta: ShadowKVStepMetadata, rope: PositionedRope) -> PositionedRope:
    """The step's RoPE tables at the exact sequences' rows (made once per table and step)."""
    if meta.exact_rows is None:
        return rope
    key = id(rope)
    if key not in meta.exact_ropes:
        rows = meta.exact_rows
        meta.exact_ropes[key] = PositionedRope(cos=rope.cos[rows], sin=rope.sin[rows], rotary=rope.rotary)
    return meta.exact_ropes[key]


def split_rows(meta: ShadowKVStepMetadata, rows: torch.Tensor, device: torch.device) -> RowSplit | None:
    """Where attend_rows' rows go in a mixed step (None unless they are trailing rows of
    each span, as SwiftKV's logit rows are)."""
    counts = meta.batch.trailing_counts(rows)
    if counts is None or meta.exact is None:
        return None
    exact_spans = {span.seq_id: span for span in meta.exact.batch.spans}
    exact_q: list[int] = []
    exact_rows: list[int] = []
    compressed_q: list[int] = []
    compressed_rows: list[int] = []
    position = 0
    for span, count in zip(meta.batch.spans, counts):
        inner = exact_spans.get(span.seq_id)
        for offset in range(count):
            row = span.query_end - count + offset
            if inner is not None:
                exact_q.append(position)
                exact_rows.append(inner.query_end - count + offset)
            else:
                compressed_q.append(position)
                compressed_rows.append(row)
            position += 1
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731 (host: see upload)
    return upload(RowSplit(as_long(exact_q), as_long(exact_rows), as_long(compressed_q),
                            as_long(compressed_rows)), device)
