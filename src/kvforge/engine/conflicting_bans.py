"""Sampling rules a request may not combine: each pair could leave no token to choose.

A structured-output constraint allows, at each step, only the ids that continue its shape,
and when the shape is complete only the EOS ids. `min_tokens` bans EOS, `allowed_token_ids`
and `bad_words` ban other ids: with the constraint (and `bad_words` with an allowed list
too), a step could find every id banned, and a sampler given only -inf has nothing to draw.
vLLM accepts these pairs; kvforge refuses them before the request is queued.
"""

from __future__ import annotations

from typing import Any

from kvforge.errors import require


def refuse_conflicting_bans(params: Any) -> None:
    """ConfigError naming the field of the first conflicting pair in `params` (SamplingParams)."""
    if params.structured_outputs is not None:
        require(params.min_tokens == 0, "min_tokens", params.min_tokens,
                "must be 0 with structured_outputs (the constraint decides where the text ends)")
        require(params.allowed_token_ids is None, "allowed_token_ids", "[...]",
                "cannot be combined with structured_outputs (the constraint decides the allowed ids)")
    require(not params.bad_words or (params.allowed_token_ids is None and params.structured_outputs is None),
            "bad_words", list(params.bad_words)[:3], "cannot be combined with allowed_token_ids or structured_outputs")
