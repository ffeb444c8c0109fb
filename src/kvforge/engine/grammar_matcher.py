"""A request's structured-output constraint run against its tokens, with llguidance.

`GrammarCompiler` (one per engine) wraps the engine's tokenizer once for llguidance (a
fraction of a second to a few seconds for a 256K vocabulary: made at the first constrained
request, or ahead by `warm_up`), checks a constraint before its request is queued, and
makes each request's matcher. At every step the matcher gives the ids that can continue a
text the constraint accepts (`allowed_masks`, all constrained rows at once); the sampler sets every other logit to -inf,
and the chosen token is fed back (`advance`).

Invariants:
- a constrained request's tokens are each allowed by its matcher when chosen, so its text
  is a prefix of a text the constraint accepts, and all of one when the matcher stops;
- when the text may end, the EOS ids are among the allowed ones; when nothing may follow,
  the matcher is stopped and the engine ends the request ("stop");
- the mask covers the model's vocabulary: ids past the tokenizer's are never allowed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from kvforge.engine.structured_output import MISSING_PACKAGE, StructuredOutputs, grammar_text
from kvforge.errors import ConfigError

CHECKED_KEPT = 256
T = TypeVar("T")


class ConstraintBroken(RuntimeError):
    """A request's matcher is in error (a parser limit, or a token it refused): that request
    alone ends, with this message."""


class GrammarCompiler:
    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._wrapped: Any = None
        self._wrap_failure: tuple[str, str] | None = None  # (value, rule) of the ConfigError, kept
        self._wrap_lock = threading.Lock()  # held while wrapping (seconds, once)
        self._checked: OrderedDict[tuple[StructuredOutputs, str], str] = OrderedDict()
        self._pristine: OrderedDict[str, Any] = OrderedDict()  # grammar -> a matcher never advanced (copied)
        self._checked_lock = threading.Lock()  # never held while compiling

    def warm_up(self) -> None:
        """Wrap the tokenizer now (a server calls it at start-up, off its event loop);
        quietly nothing when llguidance is missing or cannot read the tokenizer: the first
        constrained request then gets the error."""
        try:
            self._llg_tokenizer("structured_outputs")
        except ConfigError:
            pass

    def _llg_tokenizer(self, parameter: str) -> Any:
        """llguidance's view of the tokenizer, made once; a failure is remembered too, so
        requests that cannot be served do not wrap it again each time."""
        with self._wrap_lock:
            if self._wrapped is None and self._wrap_failure is None:
                try:
                    self._wrapped = self._wrap()
                except ConfigError as exc:
                    self._wrap_failure = (exc.value, exc.rule)
            if self._wrap_failure is not None:
                raise ConfigError(parameter, *self._wrap_failure)
            return self._wrapped

    def _wrap(self) -> Any:
        if self.tokenizer is None:
            raise ConfigError("structured_outputs", "...", "needs a tokenizer, and this model has none (dummy weights)")
        try:
            import llguidance.hf
        except ImportError:
            raise ConfigError("structured_outputs", "...", MISSING_PACKAGE) from None
        try:
            return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)),
                                                eos_token=self.eos_token_ids or None)
        except Exception as exc:  # llguidance reads the fast tokenizer's own decoder
            raise ConfigError("structured_outputs", type(self.tokenizer).__name__,
                              f"is a tokenizer llguidance cannot read ({exc})") from None

    def check(self, constraint: StructuredOutputs) -> str:
        """The compiled grammar of `constraint`; ConfigError naming its field if it is invalid.
        The CHECKED_KEPT valid ones used last are remembered (the server checks a request,
        then the engine checks it again as it is queued)."""
        key = (constraint, constraint.origin)
        with self._checked_lock:
            if key in self._checked:
                return _used(self._checked, key)
        grammar = grammar_text(constraint)  # (says what to install when llguidance is missing)
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self._llg_tokenizer(constraint.parameter))
        if error:
            raise ConfigError(constraint.parameter, constraint.shown, f"does not compile: {error.strip()[:500]}")
        with self._checked_lock:
            _keep(self._checked, key, grammar)
        return grammar

    def matcher(self, constraint: StructuredOutputs) -> Any:
        """A fresh llguidance matcher for one request (its constraint checked): a copy of a
        pristine matcher kept per grammar (the CHECKED_KEPT used last), since building one parses
        the grammar again (0.7 ms for a small JSON schema on smollm2's vocabulary), which
        the n choices of a request, or requests sharing a schema, would each pay."""
        grammar = self.check(constraint)
        with self._checked_lock:
            pristine = _used(self._pristine, grammar) if grammar in self._pristine else None
        if pristine is None:
            from llguidance import LLMatcher

            pristine = LLMatcher(self._llg_tokenizer(constraint.parameter), grammar, log_level=0)
            if pristine.is_error():
                raise ConfigError(constraint.parameter, constraint.shown,
                                  f"does not compile: {pristine.get_error()[:500]}")
            with self._checked_lock:
                _keep(self._pristine, grammar, pristine)
        return pristine.deep_copy()


def _used(kept: OrderedDict[Any, T], key: Any) -> T:
    """`kept[key]`, now the most recently used."""
    kept.move_to_end(key)
    return kept[key]


def _keep(kept: OrderedDict[Any, T], key: Any, value: T) -> None:
    """Remember `value`, forgetting the least recently used beyond CHECKED_KEPT."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > CHECKED_KEPT:
        kept.popitem(last=False)


def allowed_masks(matchers: Sequence[Any], vocab_size: int) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """Bool [len(matchers), vocab_size]: the ids that may come next under each matcher, from
    its bitmask (bit b of byte j is id 8j + b), unpacked for all rows at once; and the
    (row, reason) of the matchers that are broken, whose rows allow nothing: one in error
    (its own mask would allow only EOS, ending the request as if complete) or allowing no id."""
    broken: list[tuple[int, str]] = []
    packed: list[bytes | None] = []
    for row, matcher in enumerate(matchers):
        if matcher.is_error():
            broken.append((row, f"the structured-output constraint failed: {matcher.get_error()[:300]}"))
            packed.append(None)
        else:
            packed.append(matcher.compute_bitmask())
    width = max((len(p) for p in packed if p is not None), default=(vocab_size + 31) // 32 * 4)
    raw = np.frombuffer(b"".join(p if p is not None else bytes(width) for p in packed), dtype=np.uint8)
    bits = np.unpackbits(raw.reshape(len(matchers), width), axis=1, bitorder=_BIT_ORDER)
    masks = torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]  # (a matcher's vocabulary is at least the model's)
    failed = {row for row, _ in broken}
    empty = (~masks.any(dim=1)).nonzero().flatten().tolist()
    broken += [(row, "the structured-output constraint allows no token here") for row in empty if row not in failed]
    return masks, sorted(broken)


_BIT_ORDER = "little"  # bit 0 of a byte is its first id


def advance(matcher: Any, token: int) -> bool:
    """Feed the chosen token; True when the constraint is complete and nothing may follow.
    ConstraintBroken when the matcher refuses it (it cannot, when its mask was applied)."""
    if not matcher.consume_token(token):
        raise ConstraintBroken(f"token {token} broke the structured-output constraint: {matcher.get_error()[:300]}")
    return bool(matcher.is_stopped())
