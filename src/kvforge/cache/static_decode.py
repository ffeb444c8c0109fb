"""A cache method's decode-only steps in fixed shapes: what a CUDA graph captures.

A captured step replays the same kernels on the same addresses, so everything a step reads
must live in fixed tensors of fixed shapes. `StaticDecode` holds, for one batch bucket of
`rows` sequences whose page tables are at most `width` pages wide, the step metadata whose
tensors are such buffers (`meta`), and refills it for each step (`load`). Rows past the
step's sequences are padding: they write their K/V to a scratch page no sequence owns and
see no stored token, so they change nothing any sequence reads. Methods opt in through
`CacheMethod.static_decode` (base.py); engine/decode_graphs.py drives it. (Methods pass
what their static form needs, not themselves: a method module imports its static form.)

Invariant: running the model's `forward_step` on `meta` after `load(batch)` gives, in its
first `len(batch.spans)` rows, the logits `forward(batch)` gives, and leaves the cache in
the state `forward(batch)` leaves once `finish` and `end_step` commit `load`'s host
metadata (a method whose stores happen at `end_step`, as KIVI's flushes do, runs them
there, eagerly, from the step's K/V that `finish` hands over).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic

import torch

from kvforge.batch import ForwardBatch, SequenceSpan
from kvforge.cache.step_metadata import Meta
from kvforge.static_buffers import StaticBuffers

# Sequence ids of padding rows (an engine's ids are >= 0) and of the scratch page's owner.
PADDING_SEQ_BASE = -(2**40)
SCRATCH_SEQ = -(2**41)


def is_decode_only(batch: ForwardBatch) -> bool:
    """One new token per sequence, each with one logit row, rows in sequence order."""
    return (len(batch.logit_row_list or ()) == len(batch.spans) == batch.num_tokens
            and all(span.query_len == 1 and span.query_start == i for i, span in enumerate(batch.spans)))


def padded_batch(token_ids: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
    """The static step's batch: every row its own one-token sequence with a logit row (the
    spans stand for the buffers' shapes; the values are in `token_ids` and `positions`)."""
    rows = token_ids.shape[0]
    spans = tuple(SequenceSpan(PADDING_SEQ_BASE - i, i, 1, 0, True) for i in range(rows))
    logit_rows = torch.arange(rows, device=token_ids.device)
    return ForwardBatch(token_ids, positions, spans, logit_rows, tuple(range(rows)))


class StaticDecode(ABC, Generic[Meta]):
    """One bucket's fixed buffers and the metadata over them (see the module docstring)."""

    meta: Meta

    def __init__(self, rows: int, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        self.rows = rows
        self.buffers = StaticBuffers({"token_ids": (rows,), "positions": (rows,), **shapes}, device)
        self.batch = padded_batch(self.buffers.tensors["token_ids"], self.buffers.tensors["positions"])

    def load(self, batch: ForwardBatch) -> Meta | None:
        """Fill the buffers for `batch` (host tensors; its sequences in the first rows) and
        return the host metadata `end_step` commits; None, writing nothing, when the batch
        does not fit this bucket (not decode only, more sequences than rows, a table wider
        than the buffers)."""
        if not is_decode_only(batch) or len(batch.spans) > self.rows:
            return None
        planned = self.plan(batch)
        if planned is None:
            return None
        host_meta, values = planned
        pad = self.rows - len(batch.spans)
        values["token_ids"] = torch.nn.functional.pad(batch.token_ids.cpu(), (0, pad))
        values["positions"] = torch.nn.functional.pad(batch.positions.cpu(), (0, pad))
        self.buffers.fill(values)
        return host_meta

    # The forms of the step a bucket holds, each captured in a graph of its own: one unless
    # a method can leave work out for some batches (ShadowKV: the exact attention, when
    # every sequence of the step is compressed). `form_of` names the form that serves a
    # loaded step; every form gives the same logits for the batches it serves.
    forms: tuple[str, ...] = ("any",)

    def form_of(self, host_meta: Meta) -> str:
        """The form that runs the step `load` returned `host_meta` for."""
        del host_meta
        return self.forms[0]

    @abstractmethod
    def make_meta(self, form: str = "any") -> Meta:
        """Step metadata over the buffers in one of `forms`: made once for a capture (the
        graph holds what the step wrote into it), and afresh for each step run without one
        (a step's metadata caches what it derives from the buffers' values)."""

    def finish(self, host_meta: Meta, meta: Meta, rows: int) -> None:
        """Hand what the step over the buffers (`meta`) left for `end_step` to the host
        metadata of its `rows` real sequences (nothing by default: a method whose `write`
        stores in place leaves nothing)."""
        del host_meta, meta, rows

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> tuple[Meta, dict[str, torch.Tensor]] | None:
        """The step's host metadata (for `end_step`) and every method buffer's padded host
        values; None when the batch does not fit."""
