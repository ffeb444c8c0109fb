"""Greedy generation for a fixed set of prompts, all sequences advancing together.

A minimal loop over `ModelRunner` used by `kvforge verify`, `kvforge generate` and tests:
prompts are prefilled in chunks of `prefill_chunk` tokens (mixed with decode tokens of
sequences that finished their prompt), then every step decodes one token per live
sequence through the paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.engine.runner import ModelRunner, StepItem


def greedy_generate(runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = (), prefill_chunk: int | None = None) -> list[list[int]]:
    """Returns the generated ids of each prompt (stop token included if produced)."""
    stops = set(stop_token_ids)
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
                    items.append(StepItem(i, [outputs[i][-1]]))
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
