"""Greedy multi-turn conversations run on the engine, each turn a new request.

Turn t's prompt is everything the conversation holds so far (turn 0's tokens, each reply as
generated, stop token included, and each later turn's tokens), so with prefix caching on
the engine finds the previous turn's sequence and computes only what the new turn adds:
the same mechanism `kvforge chat` and any OpenAI client sending a growing history use.
All conversations advance one turn at a time, as one batch of requests per turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams


def converse_on_engine(engine: LLMEngine, conversations: Sequence[Sequence[Sequence[int]]], max_new_tokens: int,
                       stop_token_ids: Sequence[int] = (),
                       on_finished: Callable[[int], None] | None = None) -> list[list[list[int]]]:
    """`conversations[c][t]`: the tokens turn t adds (turn 0: the whole first prompt).
    Returns the generated ids per conversation and turn; `on_finished(c)` is called when
    conversation c has had its last turn. A request that fails raises RuntimeError."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
    outputs: list[list[list[int]]] = [[] for _ in conversations]
    history: list[list[int]] = [[] for _ in conversations]
    turns = max((len(c) for c in conversations), default=0)
    for turn in range(turns):
        active = {}
        for c, conversation in enumerate(conversations):
            if turn < len(conversation):
                history[c] += list(conversation[turn])
                active[engine.add_request(history[c], params)] = c
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                if output.error:
                    raise RuntimeError(f"conversation {active[output.request_id]}, turn {turn}: {output.error}")
                c = active[output.request_id]
                outputs[c].append(list(output.token_ids))
                history[c] += output.token_ids
                if turn == len(conversations[c]) - 1 and on_finished is not None:
                    on_finished(c)
    return outputs
