"""Attention over disjoint key sets, merged: the one home of the online-softmax mechanism.

Softmax attention over a union of key sets equals the attentions over the parts, each
weighted by its share of the total exp-sum. Two forms of that identity serve the paths that
read keys part by part (prefill chunks, tiles of stored pages):
- `LseMerge` merges parts that are already normalised attentions, each with its
  log-sum-exp (ATen's flash kernel, kernels/cpu_causal_attention, `attention_with_lse`):
  out = sum_i w_i out_i with w_i = exp(lse_i - lse), lse = log sum_i exp(lse_i).
- `OnlineSoftmax` takes raw score tiles and their values and keeps, per query row, the
  running max, the sum of exp(score - max) and the exp-weighted values, rescaling both by
  exp(old max - new max) when the max moves; the result is their quotient.

INVARIANT (both): the first part gives every row a finite max / lse (the step's own key,
or a chunk's own causal keys, which every query sees). A later part that a row does not
see (all its scores -inf, or lse -inf) then adds exactly nothing: its weight is
exp(-inf) = 0. A first part with a row that sees nothing would make that row NaN.
Callers pass float32 tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LseMerge:
    """Running merge of normalised partial attentions out [..., rows, D] with their
    log-sum-exps lse [..., rows], seeded with the first part."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.out, self.lse = out, lse

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        total = torch.logaddexp(self.lse, lse)
        self.out = self.out * torch.exp(self.lse - total)[..., None] + out * torch.exp(lse - total)[..., None]
        self.lse = total


class OnlineSoftmax:
    """Running max [..., rows, 1], sum [..., rows, 1] and exp-weighted values acc
    [..., rows, D] over score tiles [..., rows, m] (hidden keys = -inf); probabilities are
    relative to the running max, so `result()` is acc / sum."""

    def __init__(self, running_max: torch.Tensor, running_sum: torch.Tensor, acc: torch.Tensor) -> None:
        self.max, self.sum, self.acc = running_max, running_sum, acc

    @classmethod
    def first_tile(cls, scores: torch.Tensor, values: torch.Tensor) -> OnlineSoftmax:
        """Seeded with a tile: scores [P, rows, m], values [P, m, D]."""
        running_max = scores.amax(dim=-1, keepdim=True)
        probs = torch.exp(scores - running_max)
        return cls(running_max, probs.sum(dim=-1, keepdim=True), torch.bmm(probs, values))

    @classmethod
    def one_key(cls, score: torch.Tensor, value: torch.Tensor) -> OnlineSoftmax:
        """Seeded with one key per row (the step's own): score [..., rows, 1] is the running
        max, its weight exactly 1, and `value` (broadcast to [..., rows, D]) the accumulator."""
        acc = value.expand(*score.shape[:-1], value.shape[-1]).clone()
        return cls(score, torch.ones_like(score), acc)

    def add(self, scores: torch.Tensor, values: torch.Tensor,
            weigh: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """One tile: scores [..., rows, m] and values [..., m, D]. weigh(probs) -> [..., rows, D]:
        the tile's weighted values when they are not probs @ values (a reference's einsum,
        KIVI's value_dot=int8); probs are relative to the new running max."""
        new_max = torch.maximum(self.max, scores.amax(dim=-1, keepdim=True))
        probs = torch.exp(scores - new_max)
        correction = torch.exp(self.max - new_max)
        self.sum = self.sum * correction + probs.sum(dim=-1, keepdim=True)
        self.acc = self.acc * correction + (torch.bmm(probs, values) if weigh is None else weigh(probs))
        self.max = new_max

    def result(self) -> torch.Tensor:
        return self.acc / self.sum
