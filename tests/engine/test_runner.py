"""Runner and batch validation: a bad step fails alone and leaves the cache usable."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair, make_runner

from kvforge.batch import ForwardBatch
from kvforge.engine.greedy import greedy_generate
from kvforge.engine.runner import StepItem
from kvforge.errors import ConfigError


def test_batch_layout_and_validation():
    batch = ForwardBatch.build([3, 9], [[5, 6, 7], [8]], [0, 4], [2, 1])
    assert batch.positions.tolist() == [0, 1, 2, 4]
    assert batch.logit_rows.tolist() == [1, 2, 3]
    assert [(s.query_start, s.total_len) for s in batch.spans] == [(0, 3), (3, 5)]
    with pytest.raises(ConfigError, match="only once"):
        ForwardBatch.build([1, 1], [[1], [2]], [0, 0])
    with pytest.raises(ConfigError, match="at least one token"):
        ForwardBatch.build([1], [[]], [0])
    with pytest.raises(ConfigError, match="num_logits"):
        ForwardBatch.build([1], [[1, 2]], [0], [3])


def test_too_long_sequence_fails_alone():
    _, model = make_pair("llama_gqa")
    runner = make_runner(model)
    limit = model.config.max_position_embeddings
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        runner.step([StepItem(0, [1] * (limit + 1))])
    logits = runner.step([StepItem(1, [1, 2, 3])])
    assert torch.isfinite(logits).all()


def test_stale_cached_length_is_refused():
    _, model = make_pair("llama_gqa")
    runner = make_runner(model)
    runner.step([StepItem(0, [1, 2, 3])])
    stale = ForwardBatch.build([0], [[4]], [1])
    with pytest.raises(ConfigError, match="cached_len"):
        model(stale, runner.cache)


def test_greedy_batch_equals_each_alone():
    _, model = make_pair("gemma3_hybrid")
    runner = make_runner(model)
    prompts = [list(range(1, 30)), [7], list(range(40, 52))]
    together = greedy_generate(runner, prompts, max_new_tokens=12, prefill_chunk=8)
    alone = [greedy_generate(runner, [p], max_new_tokens=12)[0] for p in prompts]
    assert together == alone
    assert all(len(out) == 12 for out in together)
    assert runner.cache.memory_usage()["fast"] == 0
