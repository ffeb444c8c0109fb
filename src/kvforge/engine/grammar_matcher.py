"""A request's structured-output constraint run against its tokens, with llguidance.

`GrammarCompiler` (one per engine) wraps the engine's tokenizer once for llguidance (a
fraction of a second to a few seconds for a 256K vocabulary: made at the first constrained
request, or ahead by `warm_up`), checks a constraint before its request is queued, and
makes each request's matcher. At every step the matcher gives the ids that can continue a
text the constraint accepts (`allowed_ids`); the sampler sets every other logit to -inf,
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
from typing import Any

import numpy as np
import torch

from kvforge.engine.structured_output import MISSING_PACKAGE, StructuredOutputs, grammar_text
from kvforge.errors import ConfigError

CHECKED_KEPT = 256


class GrammarCompiler:
    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._wrapped: Any = None
        self._checked: dict[tuple[StructuredOutputs, str], str] = {}
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Wrap the tokenizer now (a server calls it at start-up, off its event loop);
        quietly nothing when llguidance is missing or cannot read the tokenizer: the first
        constrained request then gets the error."""
        try:
            self._llg_tokenizer("structured_outputs")
        except ConfigError:
            pass

    def _llg_tokenizer(self, parameter: str) -> Any:
        with self._lock:
            if self._wrapped is None:
                if self.tokenizer is None:
                    raise ConfigError(parameter, "...", "needs a tokenizer, and this model has none (dummy weights)")
                try:
                    import llguidance.hf
                except ImportError:
                    raise ConfigError(parameter, "...", MISSING_PACKAGE) from None
                try:
                    self._wrapped = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)),
                        eos_token=self.eos_token_ids or None)
                except Exception as exc:  # llguidance reads the fast tokenizer's own decoder
                    raise ConfigError(parameter, type(self.tokenizer).__name__,
                                      f"is a tokenizer llguidance cannot read ({exc})") from None
            return self._wrapped

    def check(self, constraint: StructuredOutputs) -> str:
        """The compiled grammar of `constraint`; ConfigError naming its field if it is invalid.
        The last CHECKED_KEPT valid ones are remembered (the server checks a request, then
        the engine checks it again as it is queued)."""
        key = (constraint, constraint.origin)
        with self._lock:
            if key in self._checked:
                return self._checked[key]
        grammar = grammar_text(constraint)  # (says what to install when llguidance is missing)
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self._llg_tokenizer(constraint.parameter))
        if error:
            raise ConfigError(constraint.parameter, constraint.shown, f"does not compile: {error.strip()[:500]}")
        with self._lock:
            if len(self._checked) >= CHECKED_KEPT:
                self._checked.pop(next(iter(self._checked)))
            self._checked[key] = grammar
        return grammar

    def matcher(self, constraint: StructuredOutputs) -> Any:
        """A fresh llguidance matcher for one request (its constraint checked)."""
        grammar = self.check(constraint)
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(constraint.parameter), grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(constraint.parameter, constraint.shown, f"does not compile: {matcher.get_error()[:500]}")
        return matcher


def allowed_ids(matcher: Any, vocab_size: int) -> torch.Tensor:
    """Bool [vocab_size]: the ids that may come next (True), from the matcher's bitmask (bit
    i of 32-bit word i // 32, least significant first)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    width = min(vocab_size, bits.size)
    mask[:width] = torch.from_numpy(bits[:width].astype(np.bool_))
    return mask


def advance(matcher: Any, token: int) -> bool:
    """Feed the chosen token; True when the constraint is complete and nothing may follow.
    A token the matcher refuses (impossible when the mask was applied) raises RuntimeError."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"token {token} is not allowed by the request's constraint: {matcher.get_error()}")
    return bool(matcher.is_stopped())
