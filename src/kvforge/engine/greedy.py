"""Greedy generation for a fixed set of prompts, all sequences advancing together.

A minimal loop over `ModelRunner` used by `kvforge verify`, `kvforge generate` and tests:
prompts are prefilled in chunks of `prefill_chunk` tokens (mixed with decode tokens of
sequences that finished their prompt), then every step decodes one token per live
sequence through the paged cache.

Both use sequence ids 0..n-1 of the runner's cache and refuse to start when one of them
holds tokens (a caller's own sequence would be extended and then freed). Both stop at the
model's end-of-sequence ids (chat models: the end-of-turn token) unless given other
`stop_token_ids` (`()`: never stop early).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.errors import ConfigError


def _claim(runner: ModelRunner, count: int, stop_token_ids: Sequence[int] | None) -> set[int]:
    """Check that sequence ids 0..count-1 are free; the stop ids to use."""
    for seq_id in range(count):
        held = runner.cache.num_cached_tokens(seq_id)
        if held:
            raise ConfigError("seq_id", seq_id, f"is in use in the runner's cache ({held} tokens): greedy generation "
                                                "uses ids 0..n-1; free them first or use another runner")
    return set(runner.model.config.eos_token_ids if stop_token_ids is None else stop_token_ids)


def greedy_generate(runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_token_ids: Sequence[int] | None = None, prefill_chunk: int | None = None) -> list[list[int]]:
    """Returns the generated ids of each prompt (stop token included if produced)."""
    stops = _claim(runner, len(prompts), stop_token_ids)
    fed = [0] * len(prompts)  # prompt tokens already sent
    outputs: list[list[int]] = [[] for _ in prompts]
    live = [i for i, p in enumerate(prompts) if len(p) > 0 and max_new_tokens > 0]
    try:
        while live:
            items: list[StepItem] = []
            for i in live:
                prompt = prompts[i]
                if fed[i] < len(prompt):
                    end = len(prompt) if prefill_chunk is None else min(len(prompt), fed[i] + prefill_chunk)
                    items.append(StepItem(i, prompt[fed[i]:end], num_logits=int(end == len(prompt))))
                    fed[i] = end
                else:
                    items.append(StepItem(i, [outputs[i][-1]], decode=True))
            logits = runner.step(items)
            row = 0
            finished = []
            for item in items:
                if item.num_logits == 0:
                    continue
                token = int(torch.argmax(logits[row]).item())
                row += 1
                outputs[item.seq_id].append(token)
                if token in stops or len(outputs[item.seq_id]) >= max_new_tokens:
                    finished.append(item.seq_id)
            for i in finished:
                live.remove(i)
                runner.release(i)
    finally:
        for i in range(len(prompts)):
            runner.release(i)
    return outputs


def greedy_converse(runner: ModelRunner, conversations: Sequence[Sequence[Sequence[int]]], max_new_tokens: int,
                    stop_token_ids: Sequence[int] | None = None, prefill_chunk: int | None = None
                    ) -> list[list[list[int]]]:
    """Greedy multi-turn conversations that keep their cache between turns.

    `conversations[c][t]` are the tokens the user adds in turn t (turn 0: the whole first
    prompt). A turn generates until a stop id or `max_new_tokens`; the next turn then
    feeds the turn's last generated token followed by its own tokens, so the sequence
    in the cache is always prompt + reply + question + reply ... and nothing is
    recomputed. Returns the generated ids per conversation and turn."""
    stops = _claim(runner, len(conversations), stop_token_ids)
    outputs: list[list[list[int]]] = [[[]] for _ in conversations]
    pending = [list(turns[0]) if turns else [] for turns in conversations]
    live = [c for c, turns in enumerate(conversations) if turns and len(turns[0]) > 0 and max_new_tokens > 0]
    try:
        while live:
            items: list[StepItem] = []
            for c in live:
                if pending[c]:
                    take = len(pending[c]) if prefill_chunk is None else min(len(pending[c]), prefill_chunk)
                    chunk, pending[c] = pending[c][:take], pending[c][take:]
                    items.append(StepItem(c, chunk, num_logits=int(not pending[c])))
                else:
                    items.append(StepItem(c, [outputs[c][-1][-1]], decode=True))
            logits = runner.step(items)
            row = 0
            for item in items:
                if item.num_logits == 0:
                    continue
                c = item.seq_id
                token = int(torch.argmax(logits[row]).item())
                row += 1
                outputs[c][-1].append(token)
                if token not in stops and len(outputs[c][-1]) < max_new_tokens:
                    continue
                turn = len(outputs[c])
                if turn == len(conversations[c]):
                    live.remove(c)
                    runner.release(c)
                else:
                    pending[c] = [token, *conversations[c][turn]]
                    outputs[c].append([])
    finally:
        for c in range(len(conversations)):
            runner.release(c)
    return outputs
