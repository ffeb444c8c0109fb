"""Log-likelihood of continuations given contexts, scored through `ModelRunner` batches.

A request is a pair of token lists (context, continuation), both non-empty. The model reads
`context + continuation[:-1]`; the rows from the last context token on predict the
continuation. The result is the summed log-probability of the continuation tokens (float64
log-softmax of the logits) and whether every one of them is the argmax of its row, which is
what lm-eval-harness calls `(logprob, is_greedy)`.

`mode` decides which tokens are in one step, and so what the cache method changes:
- "prefill": the whole input in one step. Every query sees the step's exact K/V, so a
  compressed cache changes nothing (a reference, and the cheapest mode).
- "cached" (default): the context in one step, then the continuation in a second step that
  reads the context from what the cache method stored, as a prompt followed by its answer
  would be.
- "decode": the context in one step, then every continuation token alone, as generation
  reads it.
Inputs longer than `max_batch_tokens` are fed in chunks of at most that many tokens in every
mode (the chunk boundaries then also pass through the cache). Requests are grouped into
batches of at most `max_batch` sequences and `max_batch_tokens` input tokens, longest first;
one step runs the next piece of every sequence of a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import require

# Rows whose float64 log-probabilities exist at once: a 4096-token window of a 262k-token
# vocabulary would otherwise need 8.6 GB per float64 copy.
NLL_ROWS = 256


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[..., target] in float64 for logits [..., N, V] and targets
    [..., N], computed NLL_ROWS rows at a time so memory stays bounded."""
    parts = []
    for start in range(0, logits.shape[-2], NLL_ROWS):
        chunk = logits[..., start:start + NLL_ROWS, :].double()
        picked = chunk.gather(-1, targets[..., start:start + NLL_ROWS].unsqueeze(-1)).squeeze(-1)
        parts.append(torch.logsumexp(chunk, dim=-1) - picked)
    return torch.cat(parts, dim=-1)


def window_nll(logits: torch.Tensor, targets: Sequence[int]) -> float:
    """Sum over rows of -log softmax(logits)[target], in float64."""
    index = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    return float(token_nll(logits, index).sum())


ScoreMode = Literal["prefill", "cached", "decode"]
SCORE_MODES: tuple[str, ...] = ("prefill", "cached", "decode")
TokenPair = tuple[Sequence[int], Sequence[int]]
ROW_BLOCK = 256  # logit rows turned into float64 log-probabilities at once


@dataclass(frozen=True)
class ScoreSettings:
    mode: ScoreMode = "cached"
    max_batch: int = 16
    # also the longest piece, so it bounds the logit rows of a step (x vocabulary x 4 bytes)
    max_batch_tokens: int = 1024
    # Sequence ids used in the runner's cache: first_seq_id, first_seq_id + 1, ... They must not
    # collide with sequences alive in the same cache (the engine numbers its requests from 0).
    first_seq_id: int = 1 << 48

    def __post_init__(self) -> None:
        require(self.mode in SCORE_MODES, "score_mode", self.mode, f"must be one of {list(SCORE_MODES)}")
        require(self.max_batch >= 1, "max_batch", self.max_batch, "must be >= 1")
        require(self.max_batch_tokens >= 1, "max_batch_tokens", self.max_batch_tokens, "must be >= 1")


@dataclass(frozen=True)
class ContinuationScore:
    logprob: float  # sum over the continuation tokens of log p(token | everything before it)
    is_greedy: bool  # every continuation token is the argmax of its row
    num_tokens: int


@dataclass(frozen=True)
class _Piece:
    tokens: list[int]
    targets: list[int]  # what the last len(targets) rows of this piece predict


def split_pieces(context: Sequence[int], continuation: Sequence[int], mode: ScoreMode,
                 chunk: int) -> list[_Piece]:
    """The steps of one request. Scored rows are a suffix of the input, so within any piece
    they are a suffix too (the `num_logits` contract of StepItem)."""
    full = list(context) + list(continuation)
    inputs = full[:-1]
    first_scored = len(context) - 1  # input position whose row predicts continuation[0]
    if mode == "prefill":
        bounds = [0, len(inputs)]
    else:
        bounds = [0, len(context)]
        bounds += range(len(context) + 1, len(inputs) + 1) if mode == "decode" else [len(inputs)]
    cuts: list[int] = [0]
    for end in bounds[1:]:
        if end <= cuts[-1]:
            continue  # "cached" with a one-token continuation: nothing after the context
        cuts += range(cuts[-1] + chunk, end, chunk)
        cuts.append(end)
    pieces = []
    for start, end in zip(cuts, cuts[1:]):
        scored_from = max(start, first_scored)
        pieces.append(_Piece(inputs[start:end], full[scored_from + 1:end + 1] if end > scored_from else []))
    return pieces


def _batches(order: list[int], lengths: list[int], settings: ScoreSettings) -> list[list[int]]:
    batches: list[list[int]] = []
    tokens = 0
    for index in order:
        if batches and len(batches[-1]) < settings.max_batch and tokens + lengths[index] <= settings.max_batch_tokens:
            batches[-1].append(index)
            tokens += lengths[index]
        else:
            batches.append([index])
            tokens = lengths[index]
    return batches


def score_continuations(runner: ModelRunner, requests: Sequence[TokenPair], settings: ScoreSettings | None = None,
                        advance: Callable[[int], None] = lambda n: None) -> list[ContinuationScore]:
    """Scores in request order; `advance(k)` is called as k requests finish."""
    settings = settings or ScoreSettings()
    for index, (context, continuation) in enumerate(requests):
        require(len(context) > 0, "context", f"request {index}", "needs at least one token (a BOS/EOS prefix)")
        require(len(continuation) > 0, "continuation", f"request {index}", "needs at least one token")
    lengths = [len(c) + len(t) - 1 for c, t in requests]
    order = sorted(range(len(requests)), key=lambda i: (-lengths[i], i))
    results: dict[int, ContinuationScore] = {}
    for batch in _batches(order, lengths, settings):
        pieces = [split_pieces(*requests[i], settings.mode, settings.max_batch_tokens) for i in batch]
        for index, score in zip(batch, _score_batch(runner, pieces, settings.first_seq_id)):
            results[index] = score
        advance(len(batch))
    return [results[i] for i in range(len(requests))]


def _score_batch(runner: ModelRunner, pieces: list[list[_Piece]], first_seq_id: int) -> list[ContinuationScore]:
    logprob = [0.0] * len(pieces)
    greedy = [True] * len(pieces)
    seqs = [first_seq_id + s for s in range(len(pieces))]
    try:
        for step in range(max(len(p) for p in pieces)):
            active = [s for s in range(len(pieces)) if step < len(pieces[s])]
            logits = runner.step([StepItem(seqs[s], pieces[s][step].tokens, len(pieces[s][step].targets))
                                  for s in active])
            row = 0
            for s in active:
                targets = pieces[s][step].targets
                if not targets:
                    continue
                for first in range(0, len(targets), ROW_BLOCK):  # bounds the float64 copy of the logits
                    block = targets[first:first + ROW_BLOCK]
                    rows = logits[row + first:row + first + len(block)]
                    logprob[s] -= window_nll(rows, block)
                    expected = torch.tensor(block, dtype=torch.long, device=rows.device)
                    greedy[s] = greedy[s] and bool((rows.argmax(dim=-1) == expected).all())
                row += len(targets)
    finally:
        for seq in seqs:
            runner.release(seq)
    return [ContinuationScore(lp, g, sum(len(p.targets) for p in ps)) for lp, g, ps in zip(logprob, greedy, pieces)]
