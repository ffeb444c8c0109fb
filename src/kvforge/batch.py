"""The flattened batch of one forward step: the contract between runner, model and cache.

Tokens of several sequences are concatenated into one row dimension `T`. Each sequence
contributes a contiguous span of rows: a prefill chunk (many rows) or a decode token (one
row). There is no prefill or decode phase: a span is just `query_len` new tokens on top of
`cached_len` tokens the cache already holds for that sequence.

Invariants (checked by `ForwardBatch.build`):
- spans are contiguous, in order, and cover rows [0, T) exactly once;
- the token at row `span.query_start + i` has position `span.cached_len + i`;
- a sequence appears at most once per step;
- `logit_rows` indexes rows of T; logits are produced only for them, in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError
from kvforge.step_plan import upload


@dataclass(frozen=True)
class SequenceSpan:
    seq_id: int
    query_start: int  # first row of this sequence in the flattened batch
    query_len: int  # rows (new tokens) of this sequence in this step
    cached_len: int  # tokens of this sequence already stored before this step
    decode: bool = False  # the rows are generated tokens fed back (not prompt tokens)

    @property
    def total_len(self) -> int:
        return self.cached_len + self.query_len

    @property
    def query_end(self) -> int:
        return self.query_start + self.query_len


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    spans: tuple[SequenceSpan, ...]
    logit_rows: torch.Tensor  # [R] int64, rows of T that need logits
    # `logit_rows` as Python ints when known (`build` keeps them): read without a device sync
    logit_row_list: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def trailing_counts(self, rows: torch.Tensor) -> list[int] | None:
        """If `rows` is, span by span in order, a run of trailing rows of each span (as
        `logit_rows` built by `build` always is), the run length per span; else None."""
        known = rows is self.logit_rows and self.logit_row_list is not None
        wanted = list(self.logit_row_list) if known else rows.tolist()  # type: ignore[arg-type]
        counts: list[int] = []
        index = 0
        for span in self.spans:
            count = 0
            while index + count < len(wanted) and span.query_start <= wanted[index + count] < span.query_end:
                count += 1
            if wanted[index:index + count] != list(range(span.query_end - count, span.query_end)):
                return None
            counts.append(count)
            index += count
        return counts if index == len(wanted) else None

    @classmethod
    def build(
        cls,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        num_logits: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        decode: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Flatten per-sequence new tokens. `num_logits[i]` trailing rows of sequence i get
        logits (default 1: the last token; 0 for a prompt chunk that does not end it)."""
        if not (len(seq_ids) == len(token_ids) == len(cached_lens)):
            raise ConfigError("batch", (len(seq_ids), len(token_ids), len(cached_lens)),
                              "seq_ids, token_ids and cached_lens must have the same length")
        if len(set(seq_ids)) != len(seq_ids):
            raise ConfigError("seq_ids", list(seq_ids), "a sequence may appear only once per step")
        wanted = list(num_logits) if num_logits is not None else [1] * len(seq_ids)
        generated = list(decode) if decode is not None else [False] * len(seq_ids)
        spans: list[SequenceSpan] = []
        flat: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for seq_id, tokens, cached, count, fed_back in zip(seq_ids, token_ids, cached_lens, wanted, generated):
            if len(tokens) == 0:
                raise ConfigError("token_ids", f"sequence {seq_id}", "each span needs at least one token")
            if cached < 0:
                raise ConfigError("cached_lens", cached, "must be >= 0")
            if not 0 <= count <= len(tokens):
                raise ConfigError("num_logits", count, f"must be in [0, {len(tokens)}] for sequence {seq_id}")
            start = len(flat)
            spans.append(SequenceSpan(int(seq_id), start, len(tokens), int(cached), bool(fed_back)))
            flat.extend(int(t) for t in tokens)
            positions.extend(range(cached, cached + len(tokens)))
            logit_rows.extend(range(len(flat) - count, len(flat)))
        # Built on the host, then one non-blocking copy (step_plan.upload): no blocking transfer.
        token_tensor, position_tensor, logit_tensor = upload(
            tuple(torch.tensor(values, dtype=torch.long) for values in (flat, positions, logit_rows)),
            torch.device(device))
        return cls(token_ids=token_tensor, positions=position_tensor, spans=tuple(spans), logit_rows=logit_tensor,
                   logit_row_list=tuple(logit_rows))
