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
    together = greedy_generate(runner, prompts, max_new_tokens=12, stop_token_ids=(), prefill_chunk=8)
    alone = [greedy_generate(runner, [p], max_new_tokens=12, stop_token_ids=())[0] for p in prompts]
    assert together == alone
    assert all(len(out) == 12 for out in together)
    assert runner.cache.memory_usage()["fast"] == 0


def test_greedy_refuses_sequence_ids_in_use_and_stops_at_the_model_eos():
    import dataclasses

    _, model = make_pair("llama_gqa")
    runner = make_runner(model)
    runner.step([StepItem(1, [5, 6, 7])])  # the caller's own sequence 1
    with pytest.raises(ConfigError, match="seq_id=1.*in use"):
        greedy_generate(runner, [[1, 2], [3, 4]], max_new_tokens=4)
    assert runner.cache.num_cached_tokens(1) == 3  # untouched, not freed
    runner.release(1)
    free_run = greedy_generate(runner, [[1, 2, 3]], max_new_tokens=6, stop_token_ids=())[0]
    model.config = dataclasses.replace(model.config, eos_token_ids=(free_run[2],))
    stopped = greedy_generate(runner, [[1, 2, 3]], max_new_tokens=6)[0]  # default: the model's EOS ids
    assert stopped == free_run[:free_run.index(free_run[2]) + 1]
