"""The training loop: schedule, data order, exact resume, data parallelism."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from distill_helpers import one_thread, random_data, tiny_distill_model, tiny_recipe, train_tiny  # noqa: F401

from kvforge.errors import ConfigError
from kvforge.tools.bench.serve_server import free_loopback_port
from kvforge.tools.swiftkv.parallel import DataParallel
from kvforge.tools.swiftkv.trainer import METRICS_FILE, Trainer, lr_factor, state_dirs


def run(recipe, interrupt_after=None, parallel=None):
    """Train a fresh tiny student; returns (trainer, records of the steps run)."""
    return train_tiny(tiny_distill_model(), recipe, parallel, interrupt_after)


def test_schedule_warms_up_then_decays_to_zero():
    total, warmup = 20, 4
    for schedule in ("linear", "cosine"):
        factors = [lr_factor(s, total, warmup, schedule) for s in range(total)]
        assert factors[:warmup] == pytest.approx([0.25, 0.5, 0.75, 1.0])
        assert factors[warmup] == pytest.approx(1.0)
        assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1:]))
        assert 0 < factors[-1] < 0.1
    assert lr_factor(12, total, warmup, "linear") == pytest.approx(0.5)
    assert lr_factor(12, total, warmup, "cosine") == pytest.approx(0.5)
    assert lr_factor(0, 10, 0, "cosine") == 1.0


def test_every_row_is_seen_once_per_epoch_and_processes_split_each_step(tmp_path):
    data = random_data(rows_wanted=12)
    recipe = tiny_recipe(tmp_path, micro_batch_size=1, grad_accum=3, max_steps=None, epochs=2)
    model = tiny_distill_model()
    ranks = [Trainer(model, data, recipe, tmp_path, DataParallel(rank, 2), progress=False) for rank in (0, 1)]
    assert ranks[0].steps_per_epoch == 2 and ranks[0].total_steps == 4
    for epoch in range(2):
        seen = []
        for step in range(epoch * 2, epoch * 2 + 2):
            parts = [torch.cat(r.micro_batches(step)).tolist() for r in ranks]
            assert not set(parts[0]) & set(parts[1])
            seen += parts[0] + parts[1]
        assert sorted(seen) == list(range(12))
    orders = [torch.cat(ranks[0].micro_batches(s)).tolist() for s in (0, 2)]
    assert orders[0] != orders[1]  # each epoch has its own order


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full, full_records = run(tiny_recipe(tmp_path / "full"))
    losses = [r["loss"] for r in full_records]
    assert len(losses) == 6 and losses[-1] < losses[0]

    recipe = tiny_recipe(tmp_path / "cut")
    _, none = run(recipe, interrupt_after=3)  # dies after step 3; the last state is step 2
    assert none is None
    assert [d.name for d in state_dirs(tmp_path / "cut")] == ["step-0000002"]
    resumed, records = run(tiny_recipe(tmp_path / "cut", resume="auto"))
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    assert [r["loss"] for r in records] == pytest.approx(losses[2:], abs=1e-6, rel=0)
    for name, p in full.model.trainable().items():
        torch.testing.assert_close(resumed.model.trainable()[name], p, atol=1e-6, rtol=0)
    logged = [json.loads(line) for line in (tmp_path / "cut" / METRICS_FILE).read_text().splitlines()]
    assert [e["step"] for e in logged] == [1, 2, 3, 4, 5, 6]  # the lost step 3 is logged once
    assert resumed.tokens_trained == full.tokens_trained


def test_resume_loads_the_state_on_the_cpu_and_restores_the_rng_states(tmp_path, monkeypatch):
    """A run on a GPU resumes with its RNG states as CPU byte tensors (what
    torch.cuda.set_rng_state_all accepts) whatever the training device. The meta device
    stands in for the GPU: a state mapped onto it holds no RNG bytes to restore."""
    run(tiny_recipe(tmp_path, max_steps=2))
    path = state_dirs(tmp_path)[-1] / "state.pt"
    state = torch.load(path, weights_only=False)
    cuda_states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    state["rng"]["cuda"] = cuda_states
    torch.save(state, path)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    torch.manual_seed(12345)  # not the saved state
    trainer = Trainer(tiny_distill_model(), random_data(), tiny_recipe(tmp_path, max_steps=2, resume="auto"),
                      tmp_path, DataParallel(0, 1, torch.device("meta")), progress=False)
    assert trainer.start() == 2
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    assert len(restored) == 2
    for got, saved in zip(restored, cuda_states):
        assert got.device.type == "cpu" and got.dtype == torch.uint8 and torch.equal(got, saved)


def test_resume_refuses_a_different_recipe(tmp_path):
    run(tiny_recipe(tmp_path, max_steps=2))
    with pytest.raises(ConfigError, match="learning-rate"):
        run(tiny_recipe(tmp_path, max_steps=2, learning_rate=5e-3, resume="auto"))


def test_too_little_data_for_one_step_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match="at least one optimizer step"):
        Trainer(tiny_distill_model(), random_data(rows_wanted=3), tiny_recipe(tmp_path), tmp_path, progress=False)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One process of a gloo data-parallel run (spawned)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    parallel = DataParallel.from_environment("cpu")
    try:
        trainer, records = run(tiny_recipe(out, grad_accum=1, max_steps=4, save_every=100), parallel=parallel)
        if parallel.is_main:
            torch.save({"losses": [r["loss"] for r in records], "params": trainer.model.trainable_state()},
                       os.path.join(out, "result.pt"))
        parallel.barrier()  # nobody tears the group down while the other still uses it
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_processes_equal_one_process_with_double_accumulation(tmp_path):
    single, records = run(tiny_recipe(tmp_path / "one", grad_accum=2, max_steps=4, save_every=100))
    out = tmp_path / "two"
    out.mkdir()
    torch.multiprocessing.spawn(_worker, args=(2, free_loopback_port(), str(out)), nprocs=2, join=True)
    result = torch.load(out / "result.pt")
    assert result["losses"] == pytest.approx([r["loss"] for r in records], abs=1e-6, rel=1e-6)
    for name, p in single.model.trainable().items():
        torch.testing.assert_close(result["params"][name], p.detach(), atol=1e-6, rtol=1e-5)
    assert not math.isclose(records[0]["loss"], records[-1]["loss"])  # it did train
