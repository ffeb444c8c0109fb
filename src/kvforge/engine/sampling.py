"""Per-request sampling: parameters and the token choice of one step (stop strings:
`stop_strings.py`; logit bias and penalties: `logit_adjustments.py`).

`sample` turns the logits of one step (one row per request) into one token per row.
Invariants:

- A row's token depends only on its own logits, its own `SamplingParams`, its banned
  ids and its own `torch.Generator`, never on the other rows of the batch. Non-greedy
  rows are therefore processed one at a time with 1-D tensor ops, and each draws exactly
  one uniform number from its own generator per step.
- Greedy rows (temperature 0, or below GREEDY_TEMPERATURE, or top_k 1) take the argmax (ties -> lowest id) and draw
  nothing from their generator.
- Banned ids (`min_tokens` not reached yet) are masked to -inf before anything else;
  a token with zero probability after masking, min-p, top-k and top-p is never returned.
- `logit_bias`, `repetition_penalty`, `frequency_penalty` and `presence_penalty` change
  the raw logits after banning and before temperature, for greedy rows too
  (`logit_adjustments.py` defines them and their order). `min_p` (after temperature,
  before top-k and top-p) drops every id whose probability is below min_p times the top
  id's; it cannot change an argmax, so greedy rows ignore it. At their neutral values none
  of them does any work, and the tokens are bitwise those without them.
- Log-probabilities are those of the *unmodified* model distribution: log_softmax of the
  raw logits, before banning, repetition penalty, temperature, min-p, top-k and top-p; only
  a structured-output constraint's mask applies (`reported_logprobs.py`).
- Everything is computed in float32 (cumulative sums in float64), whatever the logits'
  dtype.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.engine.bad_words import MAX_BAD_WORDS
from kvforge.engine.conflicting_bans import refuse_conflicting_bans
from kvforge.engine.logit_adjustments import (
    PENALTY_LIMIT,
    adjust_logits,
    adjusts_logits,
    allowed_ids,
    bias_pairs,
    needs_output,
    needs_prompt_and_output,
    penalize_repetition,
)
from kvforge.engine.reported_logprobs import TopLogprobs, chosen_logprobs, most_likely
from kvforge.engine.structured_output import StructuredOutputs
from kvforge.errors import is_int, is_real, is_unicode, require
from kvforge.kernels.cpu_fused import argmax_rows

__all__ = ["SamplingParams", "SampleOutput", "sample", "banned_token_ids", "make_generator", "most_likely",
           "keep_min_p", "penalize_repetition"]

# Cumulative probabilities carry float32 rounding (about 1e-7); a prefix whose sum is
# within this of top_p counts as reaching it, so probs [0.5, 0.3, ...] with top_p=0.8
# keep exactly two tokens.
TOP_P_TOLERANCE = 1e-6
# top-p without top-k first looks for the nucleus among this many best tokens (a partial
# top-k, far cheaper than sorting a 100k+ vocabulary), then 16x as many, and sorts the
# whole vocabulary only if needed.
NUCLEUS_CANDIDATES = 1024
_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)
# Most alternatives reported per position (OpenAI's chat API allows 20 top_logprobs).
MAX_TOP_LOGPROBS = 20

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): a float32 division by them
# overflows, and below float32's smallest value the divisor is 0.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops. Validated on construction."""

    max_tokens: int = 128
    # Stop ids and EOS are banned until this many tokens are produced; a stop string counts
    # only if it ends in the text of a later token.
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables top-p
    min_p: float = 0.0  # in [0, 1]: keep ids with probability >= min_p * the top one's; 0 disables
    repetition_penalty: float = 1.0  # > 0: rescales logits of ids already seen; 1 disables
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times an id's count in the output; 0 disables
    presence_penalty: float = 0.0  # in [-2, 2]: minus this for each id present in the output; 0 disables
    # (token id, value) pairs added to those logits, from a {id: value} mapping; values in [-100, 100]
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these ids may be chosen; None: any
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the output text is cut where one starts
    bad_words: tuple[str, ...] = ()  # vLLM's: words never completed in the output (engine/bad_words.py)
    include_stop_str_in_output: bool = False  # vLLM's: cut where the stop string ends instead
    ignore_eos: bool = False  # don't stop on the model's EOS ids
    skip_special_tokens: bool = True  # False: the text shows special tokens (a stop token's only if included)
    logprobs: bool = False  # report log_softmax(raw logits) at each chosen token (reported_logprobs.py)
    top_logprobs: int = 0  # with logprobs: also the N most likely ids of each position
    # None: off. N >= 0: the log-probability of every prompt token given the tokens before
    # it (None for the first), plus the N most likely ids at each prompt position.
    prompt_logprobs: int | None = None
    # vLLM's: the text must be JSON of a schema, match a regex, be one of a list, ... (None: free)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        require(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                "must be an integer >= 1")
        require(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
                "must be an integer >= 0")
        require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                f"must be <= max_tokens={self.max_tokens}")
        require(is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        object.__setattr__(self, "temperature", float(self.temperature))
        require(is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
                "must be an integer >= 1, or 0 to disable top-k")
        require(is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p,
                "must be in (0, 1] (1 disables top-p)")
        object.__setattr__(self, "top_p", float(self.top_p))
        require(is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p,
                "must be in [0, 1] (0 disables min-p)")
        object.__setattr__(self, "min_p", float(self.min_p))
        require(is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
                "must be a finite number > 0 (1 disables it)")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            require(is_real(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT, name, value,
                    f"must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 disables it)")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", allowed_ids(self.allowed_token_ids))
        require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < _MAX_SEED), "seed",
                self.seed, "must be None or an integer in [0, 2**64)")
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int))
        bad_ids = [t for t in self.stop_token_ids if not (is_int(t) and t >= 0)]
        require(not bad_ids, "stop_token_ids", self.stop_token_ids,
                "must be non-negative integer token ids")
        object.__setattr__(self, "stop", _as_tuple(self.stop, str))
        bad_stops = [s for s in self.stop if not (isinstance(s, str) and s)]
        require(not bad_stops, "stop", self.stop, "must be non-empty strings")
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(_as_tuple(self.bad_words, str))))
        require(all(isinstance(w, str) and w.strip() and is_unicode(w) for w in self.bad_words), "bad_words",
                self.bad_words, "must be valid Unicode strings with a non-space character")
        require(len(self.bad_words) <= MAX_BAD_WORDS, "bad_words", f"{len(self.bad_words)} words",
                f"must be at most {MAX_BAD_WORDS} words")
        require(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "must be a bool")
        require(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", self.skip_special_tokens,
                "must be a bool")
        require(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
                self.include_stop_str_in_output, "must be a bool")
        require(isinstance(self.logprobs, bool), "logprobs", self.logprobs, "must be a bool")
        require(is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                self.top_logprobs, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        require(self.top_logprobs == 0 or self.logprobs, "top_logprobs", self.top_logprobs,
                "needs logprobs=True")
        require(self.prompt_logprobs is None
                or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
                "prompt_logprobs", self.prompt_logprobs, f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
                "structured_outputs", type(self.structured_outputs).__name__, "must be a StructuredOutputs")
        refuse_conflicting_bans(self)

    @property
    def greedy(self) -> bool:
        """True when the choice is deterministic: argmax of the (masked) logits. A temperature
        below GREEDY_TEMPERATURE is greedy too (as vLLM's): dividing float32 logits by it would
        overflow (or, below float32's range, divide by zero) instead of sharpening."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @classmethod
    def greedy_params(cls, max_tokens: int = 128, **overrides: Any) -> SamplingParams:
        """Greedy decoding (temperature 0) with the other fields given by keyword."""
        return cls(max_tokens=max_tokens, temperature=0.0, **overrides)


def _as_tuple(value: Any, scalar: type) -> tuple[Any, ...]:
    """A single `scalar` becomes a 1-tuple; any other iterable becomes a tuple."""
    if isinstance(value, scalar) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return (value,)  # refused by the element checks


def banned_token_ids(params: SamplingParams, eos_token_ids: Iterable[int], num_generated: int) -> frozenset[int]:
    """Ids a request may not sample yet: its stop ids and (unless ignore_eos) the EOS ids,
    while it has produced fewer than `min_tokens` tokens; empty afterwards."""
    if num_generated >= params.min_tokens:
        return frozenset()
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return frozenset(banned)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream on `device`. seed None -> seeded nondeterministically
    (std::random_device or the clock). The same seed gives the same stream on one device
    type; CPU and CUDA streams differ."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SampleOutput:
    """One step's choices: `token_ids[i]` for row i; `logprobs[i]` is the model's
    log-probability of that token (reported_logprobs.py) when row i asked for logprobs, else None;
    `top_logprobs[i]` the row's `top_logprobs` most likely ids (empty when it asked none)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None] | None = None,
           banned: Sequence[Collection[int] | None] | None = None,
           seen: Sequence[Sequence[int] | None] | None = None,
           generated: Sequence[Mapping[int, int] | Sequence[int] | None] | None = None,
           allowed: Sequence[torch.Tensor | None] | None = None) -> SampleOutput:
    """Choose one token per row of `logits` [R, V].

    `generators[i]` is row i's stream (None -> torch's default generator on the logits'
    device, which is not reproducible per request); greedy rows never use it.
    `banned[i]` are ids row i must not produce (ids outside [0, V) are ignored).
    `seen[i]` are the ids of row i's prompt and output so far, `generated[i]` those of its
    output alone (or each one's count): read only for rows whose repetition penalty (`seen`), or frequency or
    presence penalty (`generated`), is on, which must have them.
    `allowed[i]` (bool [V], a structured-output constraint's) are the only ids row i may
    produce; applied before the other rules.
    """
    require(logits.dim() == 2, "logits", tuple(logits.shape), "must be 2-D [rows, vocab]")
    rows, vocab = logits.shape
    require(len(params) == rows, "params", len(params), f"must have one entry per logits row ({rows})")
    gens: Sequence[torch.Generator | None] = [None] * rows if generators is None else generators
    require(len(gens) == rows, "generators", len(gens), f"must have one entry per logits row ({rows})")
    bans: Sequence[Collection[int] | None] = [None] * rows if banned is None else banned
    require(len(bans) == rows, "banned", len(bans), f"must have one entry per logits row ({rows})")

    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for i, ids in enumerate(bans):
        for t in ids or ():
            if 0 <= t < vocab:
                ban_rows.append(i)
                ban_cols.append(int(t))
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    adjusted_rows = [i for i, p in enumerate(params) if adjusts_logits(p)]
    history: Sequence[Sequence[int] | None] = [None] * rows if seen is None else seen
    outputs: Sequence[Mapping[int, int] | Sequence[int] | None] = [None] * rows if generated is None else generated
    missing = [i for i in adjusted_rows if needs_prompt_and_output(params[i])
               and (i >= len(history) or history[i] is None)]
    require(not missing, "seen", missing, "must give the prompt and output ids of every row with a "
                                          "repetition_penalty")
    missing = [i for i in adjusted_rows if needs_output(params[i]) and (i >= len(outputs) or outputs[i] is None)]
    require(not missing, "generated", missing, "must give the output ids of every row with a frequency or "
                                               "presence penalty")
    # Every row greedy, nothing banned or penalised (a plain decode step): one pass over the
    # logits as they are, no float32 copy (argmax_rows is torch.argmax; None where it does
    # not apply).
    masks: Sequence[torch.Tensor | None] = [None] * rows if allowed is None else allowed
    require(len(masks) == rows, "allowed", len(masks), f"must have one entry per logits row ({rows})")
    masked_rows = [i for i, mask in enumerate(masks) if mask is not None]
    plain = len(greedy_rows) == rows and not ban_rows and not adjusted_rows and not masked_rows
    fast = argmax_rows(logits.detach()) if plain else None
    # Masked float32 view/copy; elementwise, so a row's values do not depend on the others.
    work = logits.detach() if fast is not None else logits.detach().float()  # no copy when float32
    if ban_rows:
        if work.data_ptr() == logits.data_ptr():
            work = work.clone()  # never write into the caller's logits
        device = work.device
        work[torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)] = -math.inf
    if (adjusted_rows or masked_rows) and work.data_ptr() == logits.data_ptr():
        work = work.clone()
    for i in masked_rows:
        work[i].masked_fill_(~masks[i].to(work.device), -math.inf)
    for i in adjusted_rows:
        adjust_logits(work[i], params[i], history[i] if i < len(history) else None,
                      outputs[i] if i < len(outputs) else None)

    if fast is not None:
        tokens = fast
    elif len(greedy_rows) == rows:
        tokens = work.argmax(dim=-1)
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=work.device)
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=work.device)
            tokens[index] = work.index_select(0, index).argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(work[i], p, gens[i])

    logprobs: list[float | None] = [None] * rows
    top: list[TopLogprobs] = [[] for _ in range(rows)]
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs]
    if logprob_rows:
        chosen, tops = chosen_logprobs(logits, tokens, logprob_rows, [params[i].top_logprobs for i in logprob_rows],
                                       masks)
        for i, value, row_top in zip(logprob_rows, chosen, tops):
            logprobs[i], top[i] = value, row_top
    return SampleOutput(token_ids=tokens.tolist(), logprobs=logprobs, top_logprobs=top)



def _sample_row(scores: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> torch.Tensor:
    """One draw for one non-greedy row; `scores` is the masked float32 row [V].
    Returns a 0-dim long tensor (no host sync)."""
    # Shift so the maximum is exactly 0 before dividing: no overflow for tiny temperatures,
    # and softmax always has one term equal to 1 (no NaN) unless every id is banned.
    scaled = (scores - scores.max()) / params.temperature
    if params.min_p > 0:
        scaled = keep_min_p(scaled, params.min_p)
    vocab = scaled.shape[0]
    # `probs` is sorted descending whenever top-k or top-p applies; `candidates` holds the
    # vocabulary id of each entry of `probs` (None = identity, the whole vocabulary).
    candidates: torch.Tensor | None = None
    if 0 < params.top_k < vocab:
        values, candidates = torch.topk(scaled, params.top_k)  # sorted, descending
        probs = torch.softmax(values, dim=-1)  # renormalised over the k best
    elif params.top_p < 1:
        probs, candidates = _nucleus_candidates(torch.softmax(scaled, dim=-1), params.top_p)
    else:
        probs = torch.softmax(scaled, dim=-1)  # plain temperature sampling never sorts
    if params.top_p < 1:
        # Nucleus: the smallest prefix of the sorted distribution whose mass reaches top_p;
        # at least one token.
        cumulative = probs.double().cumsum(dim=-1)
        threshold = torch.tensor([params.top_p - TOP_P_TOLERANCE], dtype=torch.float64,
                                 device=probs.device)
        keep = torch.searchsorted(cumulative, threshold) + 1  # up to the first reaching it
        positions = torch.arange(probs.shape[0], device=probs.device)
        probs = torch.where(positions < keep, probs, torch.zeros_like(probs))
    choice = _draw(probs, generator)
    return choice if candidates is None else candidates[choice]


def keep_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """`scaled` [V] (temperature applied, maximum exactly 0) with every id whose probability
    is below min_p times the top id's set to -inf. With the maximum at 0, exp(scaled) is
    each id's probability divided by the top one's, so no softmax is needed; the top id
    always stays."""
    return scaled.masked_fill(torch.exp(scaled) < min_p, -math.inf)


def _nucleus_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest `probs` [V] in descending order with their ids: enough of them to hold
    the nucleus. Tries the NUCLEUS_CANDIDATES best, then 16 times as many, and sorts the
    whole vocabulary only when those do not reach top_p. The nucleus is a prefix of the
    sorted order, so the path taken changes nothing (up to the order of exactly equal
    probabilities), and it depends on the row alone. One host sync per try."""
    vocab = probs.shape[0]
    k = NUCLEUS_CANDIDATES
    while k < vocab:
        values, ids = torch.topk(probs, k)  # sorted, descending
        if float(values.double().cumsum(dim=-1)[-1]) >= top_p - TOP_P_TOLERANCE:
            return values, ids
        k *= 16
    values, ids = torch.sort(probs, descending=True)
    return values, ids


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised non-negative `probs` [N] with one uniform number.

    `searchsorted(cdf, u * total, right=True)` is the first index whose cdf exceeds the
    target, so an index whose probability is 0 (cdf equal to its predecessor's) is never
    returned; the clamp covers u * total rounding up to total.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[-1:]
    u = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generator)
    index = torch.searchsorted(cdf, u * total, right=True)
    last_positive = torch.searchsorted(cdf, total)  # first index reaching the total mass
    return torch.minimum(index, last_positive).squeeze(0)
