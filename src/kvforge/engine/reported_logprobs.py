"""The log-probabilities a request is told about: of each chosen token, and of the most
likely alternatives at its position.

They are those of the model's own distribution: log_softmax of the raw logits, before
banned ids, logit bias, penalties, temperature, min-p, top-k and top-p. The one exception
is a structured-output constraint's mask, applied first (as vLLM does: its grammar bitmask
is applied to the logits before its sampler reads the raw log-probabilities), so a token the
shape forbids is never reported as an alternative, and the chosen token's log-probability is
renormalised over the ids the shape allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[int], alternatives: Sequence[int],
                    masks: Sequence[torch.Tensor | None]) -> tuple[list[float], list[TopLogprobs]]:
    """For each row i of `rows` (of `logits` [R, V]): the log-probability of `tokens[i]`, and
    the `alternatives[k]` (for the k-th row) most likely ids; `masks[i]` (bool [V] or None)
    is row i's constraint, whose disallowed ids have no probability."""
    index = torch.tensor(list(rows), device=logits.device)
    scores = logits.detach().index_select(0, index).float()
    for row, i in enumerate(rows):
        if masks[i] is not None:
            scores[row].masked_fill_(~masks[i].to(scores.device), -math.inf)
    scores = scores.log_softmax(dim=-1)
    chosen = scores.gather(1, tokens.index_select(0, index.to(tokens.device)).unsqueeze(1)).squeeze(1).tolist()
    count = max(alternatives, default=0)
    if not count:
        return chosen, [[] for _ in rows]
    return chosen, [top[:wanted] for top, wanted in zip(most_likely(scores, count), alternatives)]


def most_likely(logprobs: torch.Tensor, count: int) -> list[TopLogprobs]:
    """The `count` most likely (id, log-probability) pairs of each row of `logprobs` [R, V],
    most likely first (the order of exactly equal values is torch.topk's); an id of no
    probability (masked) is no alternative, so a row may have fewer."""
    values, ids = torch.topk(logprobs, min(count, logprobs.shape[-1]), dim=-1)
    return [[(i, v) for i, v in zip(row_ids, row_values) if v != -math.inf]
            for row_ids, row_values in zip(ids.tolist(), values.tolist())]
