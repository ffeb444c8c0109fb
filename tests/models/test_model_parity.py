"""The same tokens through different step shapes give the same logits, and match
transformers on the same weights: one-go prefill, chunked prefill, token-by-token
decode, and several sequences mixed in one step."""

from __future__ import annotations

import random

import torch
from conftest import make_pair, make_runner

from kvforge.engine.runner import StepItem

LENGTH = 45  # longer than every tiny sliding window, several pages of 4 tokens


def reference_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0]


def run_in_chunks(runner, seq_id: int, tokens: list[int], chunk: int) -> dict[int, torch.Tensor]:
    """Logits of the last token of each chunk, keyed by its position."""
    out = {}
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        out[start + len(piece) - 1] = runner.step([StepItem(seq_id, piece)])[0]
    return out


def test_one_go_chunked_and_decode_agree(arch):
    hf, model = make_pair(arch)
    tokens = torch.randint(0, 96, (LENGTH,), generator=torch.Generator().manual_seed(1))
    expected = reference_logits(hf, tokens)
    runner = make_runner(model)
    results = {}
    for name, chunk in (("one_go", LENGTH), ("chunks_of_7", 7), ("token_by_token", 1)):
        logits = run_in_chunks(runner, 0, tokens.tolist(), chunk)
        runner.release(0)
        results[name] = logits
        for position, row in logits.items():
            torch.testing.assert_close(row, expected[position], atol=1e-5, rtol=0,
                                       msg=f"{arch} {name} position {position}")
    # the three step shapes agree with each other on the shared final position
    finals = [r[LENGTH - 1] for r in results.values()]
    for other in finals[1:]:
        torch.testing.assert_close(other, finals[0], atol=1e-5, rtol=0)
    assert runner.cache.memory_usage()["fast"] == 0  # everything released


def test_mixed_batch_matches_single_sequences(arch):
    """Prefill chunks and decode tokens of several sequences share steps."""
    hf, model = make_pair(arch)
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (30, 1, 17, 41)]
    expected = [reference_logits(hf, torch.tensor(p)) for p in prompts]
    runner = make_runner(model)
    fed = [0] * len(prompts)
    checked = 0
    while any(f < len(p) for f, p in zip(fed, prompts)):
        items = []
        for seq_id, prompt in enumerate(prompts):
            if fed[seq_id] < len(prompt) and rng.random() < 0.8:
                take = rng.choice([1, 1, 3, 8, 13])
                end = min(len(prompt), fed[seq_id] + take)
                items.append(StepItem(seq_id, prompt[fed[seq_id]:end]))
                fed[seq_id] = end
        if not items:
            continue
        logits = runner.step(items)
        for row, item in zip(logits, items):
            position = fed[item.seq_id] - 1
            torch.testing.assert_close(row, expected[item.seq_id][position], atol=1e-5, rtol=0)
            checked += 1
    assert checked >= len(prompts)


def test_logits_only_for_requested_rows(arch):
    _, model = make_pair(arch)
    runner = make_runner(model)
    logits = runner.step([StepItem(0, [1, 2, 3], num_logits=0), StepItem(1, [4, 5]),
                          StepItem(2, [6, 7, 8], num_logits=3)])
    assert logits.shape == (4, 96)


def test_every_row_scored_matches_reference(arch):
    """num_logits = chunk length returns one row per token (perplexity, verify)."""
    hf, model = make_pair(arch)
    tokens = torch.randint(0, 96, (LENGTH,), generator=torch.Generator().manual_seed(5))
    expected = reference_logits(hf, tokens)
    runner = make_runner(model)
    first = runner.step([StepItem(0, tokens[:20].tolist(), num_logits=20)])
    rest = runner.step([StepItem(0, tokens[20:].tolist(), num_logits=LENGTH - 20)])
    torch.testing.assert_close(torch.cat((first, rest)), expected, atol=1e-5, rtol=0)
