"""What a request's own parameters do to its logits before any token is chosen: vLLM's
`allowed_token_ids`, OpenAI's `logit_bias`, vLLM's repetition penalty, and OpenAI's
frequency and presence penalties.

Applied to one float32 row [V] in place, in vLLM's order: the allowed ids (every other id
to -inf), bias, repetition, frequency, then presence. Invariants:

- Each rule reads only the row's own parameters and history, so a row's result never
  depends on the other rows of the batch; ids outside [0, V) are ignored.
- At neutral values (no allowed list, no bias, penalties 1.0 / 0.0 / 0.0) `adjusts_logits`
  is False and the sampler does no work for the row: its tokens are bitwise those without
  these fields.
- Repetition reads the prompt and the output; frequency and presence read the output only
  (OpenAI's definition: tokens "so far" in the text being generated; vLLM's too).
- Log-probabilities are reported from the raw logits, never from adjusted ones.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from kvforge.errors import is_int, is_real, require


class LogitRules(Protocol):
    """The fields of SamplingParams read here (a protocol: sampling.py imports this module)."""

    @property
    def allowed_token_ids(self) -> tuple[int, ...] | None: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...


# OpenAI's ranges: penalties in [-2, 2], a bias in [-100, 100] (at +-100 a token is in
# effect forced or banned). A bias is applied at every step: its size is bounded too.
PENALTY_LIMIT = 2.0
BIAS_LIMIT = 100.0
MAX_BIASED_TOKENS = 1024


def adjusts_logits(params: LogitRules) -> bool:
    """True when any of the rules here changes the row."""
    return (params.allowed_token_ids is not None or bool(params.logit_bias) or needs_prompt_and_output(params)
            or needs_output(params))


def needs_prompt_and_output(params: LogitRules) -> bool:
    return params.repetition_penalty != 1.0


def needs_output(params: LogitRules) -> bool:
    return params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def adjust_logits(row: torch.Tensor, params: LogitRules, seen: Sequence[int] | None,
                  generated: Mapping[int, int] | Sequence[int] | None) -> None:
    """Every rule of `params` on one float row [V], in place. `seen` (prompt and output
    ids) is read for a repetition penalty, `generated` (the output: ids, or each id's
    count) for frequency and presence penalties; each must be given when its rule is on."""
    if params.allowed_token_ids is not None:
        keep_only(row, params.allowed_token_ids)
    if params.logit_bias:
        add_logit_bias(row, params.logit_bias)
    if needs_prompt_and_output(params):
        penalize_repetition(row, seen or (), params.repetition_penalty)
    if needs_output(params):
        penalize_frequency_and_presence(row, generated or (), params.frequency_penalty, params.presence_penalty)


def bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """A {token id: value} mapping (or its pairs) as sorted (id, float) pairs, each checked."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    require(isinstance(pairs, Iterable) and not isinstance(pairs, (str, bytes)), "logit_bias", bias,
            "must map token ids to values")
    out: dict[int, float] = {}
    for pair in pairs:
        require(isinstance(pair, tuple) and len(pair) == 2, "logit_bias", bias, "must map token ids to values")
        token, value = pair
        require(is_int(token) and token >= 0, "logit_bias token id", token, "must be an integer >= 0")
        require(token not in out, "logit_bias token id", token, "must appear once")
        require(is_real(value) and -BIAS_LIMIT <= value <= BIAS_LIMIT, f"logit_bias[{token}]", value,
                f"must be a number in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]")
        out[token] = float(value)
    require(len(out) <= MAX_BIASED_TOKENS, "logit_bias", f"{len(out)} token ids",
            f"must bias at most {MAX_BIASED_TOKENS} token ids")
    return tuple(sorted(out.items()))


def allowed_ids(ids: Any) -> tuple[int, ...] | None:
    """vLLM's allowed_token_ids as sorted distinct ids (None: every id allowed), checked."""
    if ids is None:
        return None
    require(isinstance(ids, Iterable) and not isinstance(ids, (str, bytes, Mapping)), "allowed_token_ids", ids,
            "must be a list of token ids")
    ids = list(ids)
    out = tuple(sorted(set(ids))) if all(is_int(t) for t in ids) else None
    require(out is not None and all(t >= 0 for t in out), "allowed_token_ids", ids,
            "must hold token ids (integers >= 0)")
    require(bool(out), "allowed_token_ids", ids, "must hold at least one token id (omit it to allow every id)")
    return out


def keep_only(row: torch.Tensor, allowed: Sequence[int]) -> None:
    """vLLM's allowed_token_ids on one float row [V]: every other id to -inf (ids outside
    [0, V) ignored)."""
    row.masked_fill_(_dropped(allowed, row.shape[0], row.device), -math.inf)


# A request's allowed list is the same tuple at every step: its mask of dropped ids is made
# once (a list may hold most of a 150k vocabulary). Keyed by the tuple's id, the tuple kept
# in the entry so the id stays its own; the oldest entries go first.
_DROPPED: dict[tuple[int, int, str], tuple[Sequence[int], torch.Tensor]] = {}
_DROPPED_ENTRIES = 64
_dropped_lock = threading.Lock()  # (engines in several threads share it)


def _dropped(allowed: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    key = (id(allowed), vocab, str(device))
    with _dropped_lock:
        entry = _DROPPED.get(key)
        if entry is None or entry[0] is not allowed:
            dropped = torch.ones(vocab, dtype=torch.bool, device=device)
            ids = [token for token in allowed if 0 <= token < vocab]
            dropped[torch.tensor(ids, dtype=torch.long, device=device)] = False
            while len(_DROPPED) >= _DROPPED_ENTRIES:
                _DROPPED.pop(next(iter(_DROPPED)))
            entry = _DROPPED[key] = (allowed, dropped)
        return entry[1]


def add_logit_bias(row: torch.Tensor, bias: Sequence[tuple[int, float]]) -> None:
    """OpenAI's logit_bias on one float row [V]: each (id, value) adds value to that id's
    logit."""
    vocab = row.shape[0]
    pairs = [(token, value) for token, value in bias if 0 <= token < vocab]
    if not pairs:
        return
    ids = torch.tensor([token for token, _ in pairs], dtype=torch.long, device=row.device)
    row[ids] += torch.tensor([value for _, value in pairs], dtype=row.dtype, device=row.device)


def penalize_repetition(row: torch.Tensor, seen: Sequence[int], penalty: float) -> None:
    """vLLM's repetition penalty, in place on one float row [V]: the logit of every id in
    `seen` (each counted once; ids outside [0, V) ignored) is divided by `penalty` when
    positive and multiplied by it otherwise."""
    vocab = row.shape[0]
    ids = torch.tensor(sorted({t for t in seen if 0 <= t < vocab}), dtype=torch.long, device=row.device)
    values = row[ids]
    row[ids] = torch.where(values > 0, values / penalty, values * penalty)


def penalize_frequency_and_presence(row: torch.Tensor, generated: Mapping[int, int] | Sequence[int],
                                    frequency: float, presence: float) -> None:
    """OpenAI's penalties on one float row [V]: an id generated c > 0 times so far loses
    c * frequency + presence from its logit (ids outside [0, V) ignored). `generated` is the
    output's ids, or each id's count (the engine keeps those: `Request.output_counts`)."""
    vocab = row.shape[0]
    if not isinstance(generated, Mapping):
        tally: dict[int, int] = {}
        for token in generated:
            tally[token] = tally.get(token, 0) + 1
        generated = tally
    counts = {token: count for token, count in generated.items() if 0 <= token < vocab and count > 0}
    if not counts:
        return
    ids = torch.tensor(list(counts), dtype=torch.long, device=row.device)
    times = torch.tensor(list(counts.values()), dtype=row.dtype, device=row.device)
    row[ids] -= times * frequency + presence
